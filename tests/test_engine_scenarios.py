"""Scenarios on the simulated worker: the seeds' two (interference and membership) and a
preemption storm."""

from __future__ import annotations

import collections
import random

import pytest
import trio

from policies.base import attention_pairs
from service.engine.request import SamplingParams, SamplingSpec
from tests.sim_worker import (
    RecordingObserver,
    SimWorker,
    collect,
    expected_tokens,
    running_engine,
    sim_config,
)

GREEDY = SamplingSpec(temperature=0.0)

BUDGET = 256


async def interference(
    policy: str, params: dict, prompt_len: int, per_pair_ms: float = 0.0
) -> tuple[float, float, float]:
    """Four requests decode; a long prompt arrives. Returns (max decode gap, long TTFT, bound)."""
    worker = SimWorker(max_batched_tokens=8192, num_blocks=1024, per_pair_ms=per_pair_ms)
    config = sim_config(policy=policy, policy_params=params, max_batched_tokens=8192)
    greedy = SamplingParams(max_tokens=120, sampling=GREEDY)
    async with running_engine(config, worker) as engine, trio.open_nursery() as nursery:
        results = {}

        async def read(name, channel):
            results[name] = await collect(channel)

        for i in range(4):
            channel = await engine.submit([10 + i] * 16, greedy, request_id=f"d{i}")
            nursery.start_soon(read, f"d{i}", channel)
        while len(worker.plans) < 10:  # all four are decoding by now
            await trio.sleep(0.001)
        arrived = trio.current_time()
        long = await engine.submit(
            [7] * prompt_len, SamplingParams(max_tokens=4, sampling=GREEDY), request_id="long"
        )
        nursery.start_soon(read, "long", long)
    long_ttft = results["long"].times[0] - arrived
    gaps = [
        b - a
        for i in range(4)
        for a, b in zip(results[f"d{i}"].times, results[f"d{i}"].times[1:], strict=False)
        if b > arrived
    ]
    early_chunk = BUDGET - 4  # the first chunk's step: four decodes and the rest of the budget
    pairs = attention_pairs(0, early_chunk) + 4 * 200  # the decoders' contexts are < 200
    bound = worker.base_ms + worker.per_token_ms * BUDGET + worker.per_seq_ms * 5
    return max(gaps), long_ttft, (bound + per_pair_ms * pairs) / 1000


async def test_fcfs_gap_grows_with_prompt_length(autojump_clock):
    gap_1k, _, _ = await interference("fcfs", {}, 1024)
    gap_4k, _, _ = await interference("fcfs", {}, 4096)
    print(f"fcfs max decode gap: 1024 -> {gap_1k * 1000:.1f} ms, 4096 -> {gap_4k * 1000:.1f} ms")
    # the whole prompt is one step: the decoders wait at least its cost
    assert gap_1k >= (5 + 0.1 * 1024) / 1000
    assert gap_4k >= (5 + 0.1 * 4096) / 1000
    assert gap_4k > 3 * gap_1k


@pytest.mark.parametrize("prompt_len", [1024, 4096])
async def test_stall_free_gap_bounded_by_one_budget_step(autojump_clock, prompt_len):
    params = {"token_budget": BUDGET, "chunk_size": BUDGET}
    gap, ttft, bound = await interference("stall_free", params, prompt_len)
    fcfs_gap, fcfs_ttft, _ = await interference("fcfs", {}, prompt_len)
    print(
        f"L={prompt_len}: stall_free gap {gap * 1000:.1f} ms (bound {bound * 1000:.1f}), "
        f"TTFT {ttft * 1000:.0f} ms; "
        f"fcfs gap {fcfs_gap * 1000:.1f} ms, TTFT {fcfs_ttft * 1000:.0f} ms"
    )
    assert gap <= bound + 1e-9
    assert fcfs_gap > gap
    assert ttft > fcfs_ttft  # the trade: the long prompt waits longer for its first token


# Attention over the prefix: a 252-token chunk at position 3,800 costs 5x one at position 0.
PER_PAIR_MS = 4e-4


async def test_stall_free_bounds_a_deep_chunk_by_its_cost_not_its_tokens(autojump_clock):
    params = {"token_budget": BUDGET, "chunk_size": BUDGET}
    gap, ttft, bound = await interference("stall_free", params, 4096, PER_PAIR_MS)
    blind = {**params, "bound_cost": False}
    blind_gap, blind_ttft, _ = await interference("stall_free", blind, 4096, PER_PAIR_MS)
    print(
        f"stall_free with attention cost: gap {gap * 1000:.1f} ms (one early-chunk step "
        f"{bound * 1000:.1f}), TTFT {ttft * 1000:.0f} ms; by tokens only: gap "
        f"{blind_gap * 1000:.1f} ms, TTFT {blind_ttft * 1000:.0f} ms"
    )
    assert blind_gap > 3 * bound  # by tokens, the chunks deep in the prompt cost far more
    assert gap <= 1.1 * bound  # by cost, none costs more than an early one (fit error aside)
    assert ttft < 3 * blind_ttft  # the price: more, shorter steps


@pytest.mark.parametrize("policy", ["fcfs", "stall_free", "priority", "fair", "slo"])
async def test_a_queued_request_joins_at_the_very_next_iteration(autojump_clock, policy):
    worker = SimWorker()
    config = sim_config(policy=policy, max_num_seqs=2)
    greedy = SamplingParams(sampling=GREEDY)
    async with running_engine(config, worker) as engine:
        short = await engine.submit([1] * 8, SamplingParams(max_tokens=3), request_id="short")
        long = await engine.submit([2] * 8, SamplingParams(max_tokens=40), request_id="long")
        queued = await engine.submit([3] * 8, greedy, request_id="queued")
        seq = {"short": 0, "long": 1, "queued": 2}  # seq ids follow submission order
        for channel in (short, long, queued):
            await collect(channel)
    plans = worker.plans
    last_short = max(i for i, p in enumerate(plans) if seq["short"] in p.seq_ids)
    first_queued = min(i for i, p in enumerate(plans) if seq["queued"] in p.seq_ids)
    assert first_queued == last_short + 1
    assert any(seq["long"] in p.seq_ids for p in plans[first_queued:])  # long still running


async def test_slo_keeps_decode_gaps_under_its_target(autojump_clock):
    gap, ttft, _ = await interference("slo", {"itl_target_ms": 40.0}, 4096)
    print(f"slo: max decode gap {gap * 1000:.1f} ms (target 40), long TTFT {ttft * 1000:.0f} ms")
    assert gap <= 0.040
    # and it is not timid: the prompt moves in chunks far above the minimum
    assert ttft < 4096 / 16 * 0.0075


async def burst_preemptions(**guards: float) -> tuple[collections.Counter[str], list[dict]]:
    """48 short prompts with long answers at once into 64 blocks of 16 tokens: the answers
    cannot all fit, so running sequences must preempt one another. Returns the
    preemptions of each request and the engine's state every 50 ms; every answer is
    checked token by token."""
    rng = random.Random(0)
    observer = RecordingObserver()
    states: list[dict] = []
    config = sim_config(max_queue=64, **guards)
    async with running_engine(config, SimWorker(num_blocks=64)) as engine:
        engine.add_observer(observer)
        requests = []
        for i in range(48):
            prompt = [rng.randrange(1, 250) for _ in range(rng.randint(8, 64))]
            params = SamplingParams(max_tokens=rng.randint(100, 400), sampling=GREEDY)
            channel = await engine.submit(prompt, params, request_id=f"r{i}")
            requests.append((prompt, params.max_tokens, channel))
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while True:
                    states.append(engine.state())
                    await trio.sleep(0.05)

            nursery.start_soon(watch)
            for prompt, max_tokens, channel in requests:
                assert (await collect(channel)).token_ids == expected_tokens(prompt, max_tokens)
            nursery.cancel_scope.cancel()
    return collections.Counter(observer.preempted), states


async def test_a_burst_on_a_tight_cache_preempts_no_request_beyond_the_cap(autojump_clock):
    storm, _ = await burst_preemptions(max_preemptions=1000, admission_watermark=0.0)
    capped, states = await burst_preemptions()  # the defaults: 3 at most, a 5 % watermark
    print(
        f"preemptions, unguarded: {storm.total()} (at most {max(storm.values())} for one); "
        f"guarded: {capped.total()} (at most {max(capped.values())})"
    )
    assert max(storm.values()) > 3  # without the guards the same requests go again and again
    assert max(capped.values()) <= 3
    assert capped.total() <= storm.total() / 2
    # what an operator sees meanwhile in /admin/state
    assert any(s["admission_paused"] for s in states)
    assert any(s["kv_blocks_promised"] for s in states)
    # and the policy sees the pause in its view: it proposes no admission the core refuses
    assert max(s["corrections"].get("admission_paused", 0) for s in states) == 0
