"""Disaggregated prefill and decode when a side dies mid-handover (issue 55's faults), with
Mooncake's real transfer engine over loopback. The two stages are driven directly (no
router) so that each kill falls exactly between them: stage 1 to a producer with
`do_remote_decode` and max_tokens 1, the kill, stage 2 to the consumer with the answer's
kv_transfer_params.

- The producer killed after answering, before the pull: the consumer ends the request
  `kv_transfer_failed` within --kv-transfer-timeout and frees its blocks; the next request,
  through another producer, works.
- The consumer killed while the producer holds the prompt's blocks: the producer frees them
  at --kv-hold-timeout (`expired`).
No block is leaked on either side (kv_blocks_used back to 0; --debug-invariants checks the
accounting at every step meanwhile)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.server_fixtures import RunningServer, seconds_until, start_server, stop_server

pytestmark = pytest.mark.real_model
TIMEOUT_S = 3  # --kv-transfer-timeout and --kv-hold-timeout, short for a quick test
PROMPT = "The capital of France is a city that"
BODY = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}


@dataclass(slots=True)
class Trio:
    first_producer: RunningServer  # killed between the stages
    second_producer: RunningServer  # where the next request goes
    consumer: RunningServer  # killed while the second producer holds blocks


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    timeouts = ("--kv-transfer-timeout", str(TIMEOUT_S), "--kv-hold-timeout", str(TIMEOUT_S))
    roles = ("producer", "producer", "consumer")
    started = [
        start_server(
            tmp_path_factory.mktemp(role),
            "--kv-transfer-role",
            role,
            "--debug-invariants",
            *timeouts,
            wait=False,
        )
        for role in roles
    ]
    try:
        for server in started:  # they load side by side
            server.wait_healthy()
        yield Trio(*started)
    finally:
        for server in started:
            stop_server(server)


def prefill(producer: RunningServer) -> dict:
    """Stage 1: the producer computes the prompt and holds its K/V; where it waits."""
    ask = {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(f"{producer.url}/v1/completions", json=ask, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


def decode(consumer: RunningServer, params: dict) -> httpx.Response:
    """Stage 2: the consumer pulls the held K/V and decodes."""
    body = {**BODY, "kv_transfer_params": params}
    return httpx.post(f"{consumer.url}/v1/completions", json=body, timeout=60)


def kill(server: RunningServer) -> None:
    """SIGKILL, as a crash: no drain, no goodbye; its worker follows it."""
    workers = server.worker_pids()
    server.process.kill()
    server.process.wait(10)
    seconds_until(lambda: not any(map(pid_alive, workers)), 10)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def holds(server: RunningServer) -> dict:
    return server.admin_state()["kv_transfer"]["holds"]


def test_a_producer_killed_before_the_pull_fails_that_request_only(servers: Trio) -> None:
    params = prefill(servers.first_producer)
    kill(servers.first_producer)
    started = time.monotonic()
    failed = decode(servers.consumer, params)
    assert time.monotonic() - started < TIMEOUT_S + 1.0  # failed, or ended at the timeout
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["code"] == "kv_transfer_failed"
    assert servers.consumer.wait_idle()["kv_blocks_used"] == 0
    # the next request, through a producer that lives, is served whole
    answer = decode(servers.consumer, prefill(servers.second_producer))
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert servers.consumer.wait_idle()["kv_blocks_used"] == 0
    assert holds(servers.second_producer) == {
        "holding": 0, "held": 1, "released": 1, "expired": 0,
    }  # fmt: skip


def test_a_consumer_killed_while_the_producer_holds_frees_the_blocks_at_the_hold_timeout(
    servers: Trio,
) -> None:
    producer = servers.second_producer
    prefill(producer)
    held_at = time.monotonic()
    assert producer.admin_state()["kv_blocks_used"] > 0  # the prompt's blocks, held
    kill(servers.consumer)
    seconds_until(lambda: holds(producer)["holding"] == 0, TIMEOUT_S + 2.0)
    assert time.monotonic() - held_at > TIMEOUT_S - 0.5  # held until the deadline
    assert holds(producer)["expired"] == 1
    assert producer.wait_idle()["kv_blocks_used"] == 0
    # and the producer serves on
    assert httpx.post(f"{producer.url}/v1/completions", json=BODY, timeout=60).status_code == 200
