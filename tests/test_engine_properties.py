"""Property tests: random arrival traces, random policies, swaps mid-run.

Each example runs a whole engine on the simulated worker under trio's MockClock, with
block accounting checked at every iteration (debug_invariants) and a KV cache small
enough that preemption happens.
"""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.engine.engine import Engine
from service.engine.request import SamplingParams, SamplingSpec
from tests.sim_worker import (
    RecordingObserver,
    SimTokenizer,
    SimWorker,
    collect,
    expected_tokens,
    sim_config,
)

GREEDY = SamplingSpec(temperature=0.0)

POLICY_PARAMS = {
    "fcfs": st.just({}),
    "stall_free": st.fixed_dictionaries(
        {"token_budget": st.integers(8, 128), "chunk_size": st.integers(1, 64)}
    ),
    "priority": st.fixed_dictionaries(
        {"aging_rate": st.floats(0, 50), "preempt": st.booleans(), "chunk_size": st.integers(1, 64)}
    ),
    "fair": st.fixed_dictionaries(
        {"weights": st.dictionaries(st.sampled_from("abc"), st.floats(0.1, 4), max_size=3)}
    ),
    "slo": st.fixed_dictionaries(
        {"itl_target_ms": st.floats(5, 50), "min_chunk": st.integers(1, 32)}
    ),
}
policies = st.sampled_from(sorted(POLICY_PARAMS)).flatmap(
    lambda name: POLICY_PARAMS[name].map(lambda params: (name, params))
)
arrivals = st.tuples(
    st.floats(0, 0.2),  # delay after the previous arrival, seconds
    st.integers(1, 120),  # prompt length
    st.integers(1, 24),  # max_tokens
    st.integers(0, 3),  # priority
    st.sampled_from("abc"),  # tenant
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=st.lists(arrivals, min_size=1, max_size=10),
    first=policies,
    swaps=st.lists(st.tuples(st.floats(0, 0.5), policies), max_size=3),
    num_blocks=st.integers(10, 40),
    max_batched_tokens=st.integers(16, 256),
    max_num_seqs=st.integers(1, 6),
)
def test_every_request_finishes_once_with_its_tokens(
    trace, first, swaps, num_blocks, max_batched_tokens, max_num_seqs
):
    config = sim_config(
        policy=first[0],
        policy_params=first[1],
        max_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_queue=64,
    )
    worker = SimWorker(num_blocks=num_blocks, block_size=16)
    results: dict[str, object] = {}
    observer = RecordingObserver()
    prompts: dict[str, list[int]] = {}

    async def scenario():
        engine = Engine(config, worker, SimTokenizer())
        engine.add_observer(observer)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            async with trio.open_nursery() as clients:
                clients.start_soon(swap_policies, engine)
                for i, (delay, prompt_len, max_tokens, priority, tenant) in enumerate(trace):
                    await trio.sleep(delay)
                    prompt = [(i * 7 + k) % 250 + 1 for k in range(prompt_len)]
                    prompts[f"r{i}"] = prompt
                    params = SamplingParams(max_tokens=max_tokens, sampling=GREEDY)
                    channel = await engine.submit(
                        prompt, params, request_id=f"r{i}", tenant=tenant, priority=priority
                    )
                    clients.start_soon(read, f"r{i}", channel)
            assert engine.state()["kv_blocks_used"] == 0
            engine.scheduler.blocks.check_invariants()
            nursery.cancel_scope.cancel()

    async def swap_policies(engine):
        for delay, (name, params) in swaps:
            await trio.sleep(delay)
            engine.set_policy(name, params)

    async def read(name, channel):
        results[name] = await collect(channel)

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))

    assert sorted(results) == sorted(prompts)
    for i, (_, _, max_tokens, _, _) in enumerate(trace):
        got = results[f"r{i}"]
        assert got.finish.reason == "length", got.finish
        assert got.finish.completion_tokens == max_tokens
        # no token lost or duplicated, whatever the batch, swap or preemption
        assert got.token_ids == expected_tokens(prompts[f"r{i}"], max_tokens)
    # every admitted request ended exactly once, as reported to observers too
    assert sorted(s.request_id for s in observer.finished) == sorted(prompts)
    assert sum(s.preemptions for s in observer.finished) == len(observer.preempted)
    for plan in worker.plans:
        assert plan.total_tokens <= max_batched_tokens
        assert len(plan.seq_ids) <= max_num_seqs


async def _priority_stream(aging_rate: float, gap: float, horizon: float) -> float | None:
    """One priority-9 request amid a stream of priority-0 ones (lower runs first, as in
    vLLM), one sequence at a time.

    The stream arrives faster than it is served and goes on until the low-priority
    (priority-9) request finishes or `horizon` seconds pass. Returns when it finished, or None.
    """
    config = sim_config(policy="priority", policy_params={"aging_rate": aging_rate}, max_num_seqs=1)
    engine = Engine(config, SimWorker(), SimTokenizer())
    params = SamplingParams(max_tokens=4, sampling=GREEDY)
    low_done: list[float] = []

    async def read_low(channel):
        await collect(channel)
        low_done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with trio.open_nursery() as clients:
            first = await engine.submit([1] * 8, params, request_id="h-first", priority=0)
            clients.start_soon(collect, first)
            low = await engine.submit([2] * 8, params, request_id="low", priority=9)
            clients.start_soon(read_low, low)
            i = 0
            while not low_done and trio.current_time() < horizon:
                await trio.sleep(gap)
                channel = await engine.submit([3] * 8, params, request_id=f"h{i}", priority=0)
                clients.start_soon(collect, channel)
                i += 1
            engine.begin_shutdown()
            await engine.drain(timeout=0)
        nursery.cancel_scope.cancel()
    return low_done[0] if low_done and low_done[0] < horizon else None


@settings(max_examples=10, deadline=None)
@given(aging_rate=st.floats(3.0, 50.0), gap=st.floats(0.01, 0.02))
def test_nobody_starves_under_priority_aging(aging_rate, gap):
    low_done = trio.run(
        _priority_stream, aging_rate, gap, 10.0, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    assert low_done is not None, "the low-priority request starved"


def test_without_aging_the_low_priority_request_starves():
    # the control for the test above: the same stream does starve it when nothing ages
    low_done = trio.run(
        _priority_stream, 0.0, 0.015, 10.0, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    assert low_done is None
