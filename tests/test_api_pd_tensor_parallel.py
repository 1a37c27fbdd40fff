"""Disaggregated prefill and decode between two tensor-parallel servers (issue 55, item 5):
a producer and a consumer, each `cadence serve --tensor-parallel-size 3` on the CPU (the
default model's 3 KV heads and 9 heads split in 1 or 3 only), with Mooncake's real transfer
engine over loopback. Each rank has its own engine and pulls its shard (its KV head) from
the same rank of the producer (gpu_worker.kv_ranks). The two
stages are driven directly, as tests/test_api_pd_faults.py does.

The pair's greedy completions in float32 equal one server's; afterwards both sides' blocks
are all free and every hold was released by the consumer's notices (each rank's: a hold
ends only once every rank has been read), none expired; --debug-invariants checks the
accounting at every step meanwhile. A consumer refuses params that list another number of
producer ranks than its own with a 400."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.server_fixtures import RunningServer, start_server, stop_server

pytestmark = pytest.mark.real_model

WORLD = 3
PROMPTS = [
    "The capital of France is a city that",
    "Once upon a time, in a quiet village by the sea, there lived an old fisherman who",
]
MAX_TOKENS = 6
KV_BYTES = str(48 * 1024 * 1024)  # the group's cache, small: it is zeroed at start


@dataclass(slots=True)
class Pair:
    producer: RunningServer
    consumer: RunningServer


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    group = ("--tensor-parallel-size", str(WORLD), "--debug-invariants", "--kv-memory", KV_BYTES)
    started = [
        start_server(
            tmp_path_factory.mktemp(f"tp-{role}"), "--kv-transfer-role", role, *group, wait=False
        )
        for role in ("producer", "consumer")
    ]
    try:
        for server in started:  # they load side by side
            server.wait_healthy()
        yield Pair(*started)
    finally:
        for server in started:
            stop_server(server)


def body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def prefill(producer: RunningServer, prompt: str) -> dict:
    """Stage 1: the producer computes the prompt and holds its K/V on every rank."""
    ask = {**body(prompt), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(f"{producer.url}/v1/completions", json=ask, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


def decode(consumer: RunningServer, prompt: str, params: dict) -> httpx.Response:
    """Stage 2: the consumer's ranks pull their shards and it decodes."""
    request = {**body(prompt), "kv_transfer_params": params}
    return httpx.post(f"{consumer.url}/v1/completions", json=request, timeout=120)


def text(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def test_the_pairs_greedy_completions_equal_one_servers_and_every_hold_is_released(
    pair: Pair, cadence_server: RunningServer
) -> None:
    for prompt in PROMPTS:
        params = prefill(pair.producer, prompt)
        ranks = params["remote_ranks"]
        assert len(ranks) == WORLD and len({r["remote_port"] for r in ranks}) == WORLD
        assert ranks[0]["remote_port"] == params["remote_port"]  # vLLM's fields: rank 0's
        whole = httpx.post(f"{cadence_server.url}/v1/completions", json=body(prompt), timeout=60)
        assert text(decode(pair.consumer, prompt, params)) == text(whole)
    assert pair.consumer.wait_idle()["kv_blocks_used"] == 0
    assert pair.producer.wait_idle()["kv_blocks_used"] == 0
    transfer = pair.producer.admin_state()["kv_transfer"]
    assert transfer["holds"] == {
        "holding": 0, "held": len(PROMPTS), "released": len(PROMPTS), "expired": 0,
    }  # fmt: skip
    # every rank gathered each prompt into its arena, and each consumer rank read its own
    assert transfer["staging"]["staged"] == len(PROMPTS)


def test_params_listing_another_number_of_ranks_are_refused(pair: Pair) -> None:
    params = prefill(pair.producer, PROMPTS[0])
    one_rank = {k: v for k, v in params.items() if k != "remote_ranks"}
    for wrong in (one_rank, {**params, "remote_ranks": params["remote_ranks"][:2]}):
        answer = decode(pair.consumer, PROMPTS[0], wrong)
        assert answer.status_code == 400, answer.text
        assert "remote_ranks" in answer.json()["error"]["message"]
    assert text(decode(pair.consumer, PROMPTS[0], params))  # the hold is still there
