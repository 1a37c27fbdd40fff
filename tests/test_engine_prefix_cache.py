"""The prefix cache in the engine, on the simulated worker: requests that share a prefix
start from its cached blocks, and their outputs are exactly those without the cache, alone,
together, after preemption, after eviction, under every policy.

The simulated worker's sampled token is a function of what it reads back from its KV slots,
and it checks that no block is overwritten under a sequence that read it, so a wrong hit, a
shared block written, or a block evicted while in use changes an output or fails a step.
"""

from __future__ import annotations

import random

import pytest
import trio

from policies.registry import POLICIES
from tests.sim_worker import (
    RecordingObserver,
    SimWorker,
    collect,
    expected_tokens,
    greedy,
    running_engine,
    sim_config,
)

BLOCK = 16  # SimWorker's block size


def system_prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


async def run_one(engine, prompt: list[int], max_tokens: int, request_id: str):
    channel = await engine.submit(prompt, greedy(max_tokens), request_id=request_id)
    return await collect(channel)


def first_start(worker: SimWorker, seq_index: int) -> int:
    """Where the first chunk of the `seq_index`-th sequence (0-based, by seq_id) began."""
    seq_ids = sorted({s for plan in worker.plans for s in plan.seq_ids})
    seq_id = seq_ids[seq_index]
    for plan in worker.plans:
        if seq_id in plan.seq_ids:
            return plan.start_pos[plan.seq_ids.index(seq_id)]
    raise AssertionError(f"sequence {seq_id} never ran")


@pytest.mark.parametrize(
    ("prompt_len", "hit"),
    [
        (100, 96),  # six full blocks cached, the partial seventh computed
        (64, 48),  # block-aligned: the last block is computed again, for its last token
        (15, 0),  # no full block
    ],
)
async def test_a_repeated_prompt_starts_from_its_cached_full_blocks(
    autojump_clock, prompt_len: int, hit: int
):
    prompt = system_prompt(prompt_len)
    worker = SimWorker()
    async with running_engine(sim_config(), worker) as engine:
        first = await run_one(engine, prompt, 5, "first")
        again = await run_one(engine, prompt, 5, "again")
        state = engine.state()["prefix_cache"]
    assert first.token_ids == again.token_ids == expected_tokens(prompt, 5)
    assert first_start(worker, 0) == 0 and first_start(worker, 1) == hit
    assert (first.finish.cached_tokens, again.finish.cached_tokens) == (0, hit)
    assert state["hits_tokens"] == hit and state["queries_tokens"] == 2 * prompt_len


async def test_only_requests_with_the_same_cache_salt_share(autojump_clock):
    """vLLM's cache_salt: a tenant's prefixes are found by its own requests only."""
    prompt = system_prompt(100)
    worker = SimWorker()
    async with running_engine(sim_config(), worker) as engine:
        for name, salt in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("none", None)]:
            params = greedy(3, cache_salt=salt)
            await collect(await engine.submit(prompt, params, request_id=name))
    assert [first_start(worker, i) for i in range(4)] == [0, 0, 96, 0]


async def test_with_the_cache_off_nothing_is_shared(autojump_clock):
    prompt = system_prompt(100)
    worker = SimWorker()
    async with running_engine(sim_config(enable_prefix_caching=False), worker) as engine:
        await run_one(engine, prompt, 5, "first")
        again = await run_one(engine, prompt, 5, "again")
        state = engine.state()["prefix_cache"]
    assert again.token_ids == expected_tokens(prompt, 5)
    assert first_start(worker, 1) == 0 and again.finish.cached_tokens == 0
    assert state == {
        "enabled": False,
        "cached_blocks": 0,
        "evictable_blocks": 0,
        "queries_tokens": 200,
        "hits_tokens": 0,
        "hit_rate": 0.0,
        "evicted_blocks": 0,
    }


async def test_generated_tokens_are_cached_too(autojump_clock):
    """A chat's next turn sends the previous answer back: its blocks are found as well."""
    prompt = system_prompt(40)
    async with running_engine(sim_config(), SimWorker()) as engine:
        first = await run_one(engine, prompt, 40, "turn1")
        history = prompt + first.token_ids + system_prompt(10, seed=1)
        second = await run_one(engine, history, 4, "turn2")
    # 80 tokens were computed (the last sampled one never is): five full blocks
    assert second.finish.cached_tokens == 64
    assert second.token_ids == expected_tokens(history, 4)


async def test_a_block_is_shared_only_once_its_step_has_returned(autojump_clock):
    """Two equal prompts in one step both compute it: a hit never names a block that a
    step still in flight (or a failed one) is writing."""
    prompt = system_prompt(64)
    worker = SimWorker()
    async with running_engine(sim_config(), worker) as engine, trio.open_nursery() as nursery:
        for name in ("a", "b"):
            channel = await engine.submit(prompt, greedy(3), request_id=name)
            nursery.start_soon(collect, channel)
    assert worker.plans[0].start_pos == [0, 0]


async def test_requests_sharing_a_system_prompt_get_their_own_exact_answers(autojump_clock):
    system = system_prompt(200)
    questions = [system + system_prompt(5 + 7 * i, seed=i + 1) for i in range(8)]
    worker = SimWorker()
    outputs = {}
    async with running_engine(sim_config(), worker) as engine:
        await run_one(engine, [*system, 65], 2, "warm")

        async def ask(i: int, prompt: list[int]) -> None:
            outputs[i] = await run_one(engine, prompt, 12, f"q{i}")

        async with trio.open_nursery() as nursery:  # all at once, beside one another
            for i, prompt in enumerate(questions):
                nursery.start_soon(ask, i, prompt)
    for i, prompt in enumerate(questions):
        assert outputs[i].token_ids == expected_tokens(prompt, 12)
        assert outputs[i].finish.cached_tokens >= 192  # the system prompt's full blocks


async def test_the_reset_forgets_every_cached_prefix(autojump_clock):
    prompt = system_prompt(100)
    worker = SimWorker()
    async with running_engine(sim_config(), worker) as engine:
        await run_one(engine, prompt, 5, "first")
        assert engine.state()["prefix_cache"]["cached_blocks"] == 6
        assert engine.reset_prefix_cache() == 6
        assert engine.state()["prefix_cache"]["cached_blocks"] == 0
        again = await run_one(engine, prompt, 5, "again")
    assert first_start(worker, 1) == 0 and again.finish.cached_tokens == 0
    assert again.token_ids == expected_tokens(prompt, 5)


async def shared_prefix_trace(
    policy: str, *, caching: bool, num_blocks: int, seed: int, aborts: bool = False
) -> tuple[dict[str, list[int]], RecordingObserver, dict]:
    """Conversations that share system prompts arrive in bursts on a small cache, some
    repeated; with `aborts`, some are aborted mid-way and the policy is swapped now and
    then: what each finished request generated, by request."""
    rng = random.Random(seed)
    systems = [system_prompt(rng.randint(20, 90), seed=100 + k) for k in range(3)]
    observer = RecordingObserver()
    config = sim_config(policy=policy, enable_prefix_caching=caching, max_batched_tokens=128)
    outputs: dict[str, list[int]] = {}
    async with running_engine(config, SimWorker(num_blocks=num_blocks)) as engine:
        engine.add_observer(observer)

        async def one(name: str, prompt: list[int], max_tokens: int) -> None:
            channel = await engine.submit(prompt, greedy(max_tokens), request_id=name)
            got = await collect(channel)
            if got.finish.reason != "abort":
                outputs[name] = got.token_ids
                assert got.token_ids == expected_tokens(prompt, max_tokens)

        async with trio.open_nursery() as nursery:
            for i in range(36):
                prompt = rng.choice(systems) + system_prompt(rng.randint(1, 40), seed=i % 9)
                nursery.start_soon(one, f"r{i}", prompt, rng.randint(1, 30))
                await trio.sleep(rng.choice([0, 0, 0.01, 0.05]))
                if aborts and rng.random() < 0.2:
                    engine.abort(f"r{rng.randrange(i + 1)}")
                if aborts and rng.random() < 0.15:
                    engine.set_policy(rng.choice(sorted(POLICIES)), {})
        state = engine.state()
    return outputs, observer, state


@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_every_policy_gives_the_same_answers_with_the_cache_on_and_off(
    autojump_clock, policy: str
):
    on, observer, state = await shared_prefix_trace(policy, caching=True, num_blocks=40, seed=3)
    off, _, _ = await shared_prefix_trace(policy, caching=False, num_blocks=40, seed=3)
    assert on == off and len(on) == 36
    assert state["prefix_cache"]["hits_tokens"] > 0
    assert sum(s.cached_tokens for s in observer.finished) > 0


async def test_preemption_and_eviction_keep_answers_exact(autojump_clock):
    """A cache too small for the burst: sequences are preempted (their blocks turn
    evictable, and they come back through their own cached prefix) and cached blocks are
    evicted for new ones; every answer is still exact (checked inside the trace)."""
    outputs, observer, state = await shared_prefix_trace(
        "fcfs", caching=True, num_blocks=24, seed=5
    )
    assert len(outputs) == 36
    assert observer.preempted, "the cache was not tight enough to preempt"
    cache = state["prefix_cache"]
    assert cache["hits_tokens"] > 0 and cache["evicted_blocks"] > 0


@pytest.mark.parametrize("seed", range(4))
async def test_aborts_and_policy_swaps_amid_shared_prefixes_free_every_reference(
    autojump_clock, seed: int
):
    outputs, observer, state = await shared_prefix_trace(
        "stall_free", caching=True, num_blocks=32, seed=seed, aborts=True
    )
    # debug_invariants checked the blocks every iteration; at the end nothing is held
    assert state["kv_blocks_used"] == 0 and state["running"] == state["waiting"] == 0
    assert state["prefix_cache"]["cached_blocks"] == state["prefix_cache"]["evictable_blocks"]
    assert len(outputs) + sum(1 for s in observer.finished if s.finish_reason == "abort") == 36
    assert observer.swaps and state["prefix_cache"]["hits_tokens"] > 0


async def test_fair_bills_a_tenant_for_what_it_computes_not_for_its_cache_hits(autojump_clock):
    """Under `fair`, a prompt found in the prefix cache costs its tenant only the tokens
    computed: a tenant whose 96-token hit were billed would fall behind a cold one."""
    prompt, cold = system_prompt(100, seed=1), system_prompt(100, seed=2)
    snapshots: list[dict[str, float]] = []
    async with running_engine(sim_config(policy="fair")) as engine:

        class Counters(RecordingObserver):
            def on_iteration(self, stats) -> None:
                snapshots.append(dict(engine.scheduler.policy.counters))

        engine.add_observer(Counters())
        await collect(await engine.submit(prompt, greedy(2), request_id="warm", tenant="a"))
        snapshots.clear()
        async with trio.open_nursery() as nursery:
            for request_id, ids, tenant in [("hit", prompt, "a"), ("cold", cold, "b")]:
                channel = await engine.submit(ids, greedy(3), request_id=request_id, tenant=tenant)
                nursery.start_soon(collect, channel)
    both = next(s for s in snapshots if {"a", "b"} <= set(s))
    assert both["b"] - both["a"] >= 100 - 4 - 3  # b computed 100, a 4 (and a decode or two)
