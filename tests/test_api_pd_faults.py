"""Disaggregated prefill and decode when a side dies mid-handover (issue 55's faults), with
Mooncake's real transfer engine over loopback. The two stages are driven directly (no
router) so that each kill falls exactly between them: stage 1 to a producer with
`do_remote_decode` and max_tokens 1, the kill, stage 2 to the consumer with the answer's
kv_transfer_params.

- The producer hung (its worker stopped), then killed, after answering and before the pull: the
  consumer ends the request `kv_transfer_failed` at --kv-transfer-timeout (hung) or at once
  (killed) and frees its blocks; the next request, through another producer, works.
- The consumer killed while the producer holds the prompt's blocks: the producer frees them
  at --kv-hold-timeout (`expired`).
No block is leaked on either side (kv_blocks_used back to 0; --debug-invariants checks the
accounting at every step meanwhile)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.server_fixtures import RunningServer, seconds_until, start_server, stop_server

pytestmark = pytest.mark.real_model
TIMEOUT_S = 3  # --kv-transfer-timeout, short for a quick test
# --kv-hold-timeout: short too, but a hold must outlast a handover on a busy 2-core machine
# (an 8-token prompt's two stages took 3.5 s there beside other tests)
HOLD_S = 6
PROMPT = "The capital of France is a city that"
BODY = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}


@dataclass(slots=True)
class Trio:
    first_producer: RunningServer  # hung, then killed, between the stages
    second_producer: RunningServer  # where the next request goes
    consumer: RunningServer  # killed while the second producer holds blocks


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    timeouts = ("--kv-transfer-timeout", str(TIMEOUT_S), "--kv-hold-timeout", str(HOLD_S))
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
            for pid in server.worker_pids():  # a test that failed may leave one stopped
                signal_if_alive(pid, signal.SIGCONT)
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
    """SIGKILL to the server and its worker, as a crash: no drain, no goodbye."""
    workers = server.worker_pids()
    for pid in [server.process.pid, *workers]:
        signal_if_alive(pid, signal.SIGKILL)
    server.process.wait(10)
    seconds_until(lambda: not any(map(pid_alive, workers)), 10)


def signal_if_alive(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def holds(server: RunningServer) -> dict:
    return server.admin_state()["kv_transfer"]["holds"]


def assert_kv_transfer_failed(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "kv_transfer_failed"


def test_a_producer_hung_or_killed_before_the_pull_fails_that_request_only(servers: Trio) -> None:
    producer, consumer = servers.first_producer, servers.consumer
    # a handover first: the consumer's engine knows this peer (a first contact with a
    # hung peer waits out Mooncake's handshake, 60 s, whatever the timeouts)
    assert decode(consumer, prefill(producer)).status_code == 200
    for_the_hang, for_the_kill = prefill(producer), prefill(producer)
    # it hangs: its worker, whose transfer engine serves the K/V, answers nothing
    signal_if_alive(producer.worker_pids()[-1], signal.SIGSTOP)
    started = time.monotonic()
    assert_kv_transfer_failed(decode(consumer, for_the_hang))
    assert TIMEOUT_S - 0.5 < time.monotonic() - started < TIMEOUT_S + 3.0
    # the transfer engine gives up soon after (at the timeout, 5 s at least; not its own
    # 30 s) and lets go of the blocks it wrote; later pulls wait behind it until then
    seconds_until(lambda: consumer.admin_state()["kv_blocks_used"] == 0, TIMEOUT_S + 4.0)
    kill(producer)
    started = time.monotonic()
    assert_kv_transfer_failed(decode(consumer, for_the_kill))
    assert time.monotonic() - started < TIMEOUT_S  # refused at once: nothing listens
    assert consumer.wait_idle()["kv_blocks_used"] == 0
    # the next request, through a producer that lives, is served whole
    answer = decode(consumer, prefill(servers.second_producer))
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert consumer.wait_idle()["kv_blocks_used"] == 0
    assert holds(servers.second_producer) == {
        "holding": 0, "held": 1, "released": 1, "expired": 0,
    }  # fmt: skip


def test_a_consumer_killed_while_the_producer_holds_frees_the_blocks_at_the_hold_timeout(
    servers: Trio,
) -> None:
    producer = servers.second_producer
    released = holds(producer)["released"]
    prefill(producer)
    assert producer.admin_state()["kv_blocks_used"] > 0  # the prompt's blocks, held
    kill(servers.consumer)
    assert holds(producer)["holding"] == 1  # the consumer's death alone frees nothing
    # freed at the hold's deadline (counted from its step, which a busy machine makes long)
    seconds_until(lambda: holds(producer)["holding"] == 0, HOLD_S + 2.0)
    assert holds(producer)["expired"] == 1 and holds(producer)["released"] == released
    assert producer.wait_idle()["kv_blocks_used"] == 0
    # and the producer serves on
    assert httpx.post(f"{producer.url}/v1/completions", json=BODY, timeout=60).status_code == 200
