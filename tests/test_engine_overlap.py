"""Overlapped scheduling: step k+1 goes to the worker before step k's text, events and
report, and every output stays exactly what the sequential loop gives.

The simulated worker records when each plan arrives and when each result is taken, and
how long each plan kept it waiting; emit costs are modelled by jumping the MockClock inside
the engine's own part, so nothing here measures wall-clock time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_worker.protocol import StepPlan
from service.config import Config
from service.engine.engine import CPU_OVERLAP_SEQS, Engine
from service.engine.invariants import check_invariants
from service.engine.request import SamplingParams, SamplingSpec
from service.engine.stats import IterationStats
from tests.sim_worker import (
    Collected,
    RecordingObserver,
    SimTokenizer,
    SimWorker,
    collect,
    expected_tokens,
    greedy,
    running_engine,
    sim_config,
)
from tests.test_engine_properties import policies

GREEDY = SamplingSpec(temperature=0.0)


@dataclass(slots=True)
class Reference:
    """What the sequential loop streams for a request that nobody aborts."""

    tokens: list[int]
    text: str
    finish: tuple[str, str]


def reference(prompt: list[int], max_tokens: int, stop: str | None) -> Reference:
    tokens = expected_tokens(prompt, max_tokens)
    text = bytes(tokens).decode()  # the simulated worker samples letters a..z
    at = text.find(stop) if stop else -1
    if at < 0:
        return Reference(tokens, text, ("length", "max_tokens"))
    return Reference(tokens[: at + len(stop)], text[:at], ("stop", "stop_string"))


arrivals = st.tuples(
    st.floats(0, 0.1),  # delay after the previous arrival, seconds
    st.integers(1, 100),  # prompt length
    st.integers(1, 30),  # max_tokens
    # a stop string cut from the request's own output (where, how long), so it ends it
    # mid-stream; it may also match earlier
    st.none() | st.tuples(st.integers(0, 29), st.integers(1, 3)),
    # the client aborts this long after submitting, or as the plan of this step (counted
    # from its submission) reaches the worker: then the previous step's tokens are committed
    # but, with overlap, not yet sent
    st.none() | st.floats(0, 0.3) | st.integers(1, 40),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=st.lists(arrivals, min_size=1, max_size=10),
    first=policies,
    swaps=st.lists(st.tuples(st.floats(0, 0.5), policies), max_size=3),
    num_blocks=st.integers(10, 40),
    max_batched_tokens=st.integers(16, 256),
    max_num_seqs=st.integers(1, 6),
    # "auto" beside a CPU worker overlaps the steps of few sequences only: both kinds mix
    overlap=st.sampled_from(["on", "off", "auto"]),
)
def test_outputs_are_the_sequential_loops_whatever_ends_a_request(
    trace, first, swaps, num_blocks, max_batched_tokens, max_num_seqs, overlap
):
    config = sim_config(
        policy=first[0],
        policy_params=first[1],
        max_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_queue=64,
        overlap=overlap,
    )
    run = TraceRun(config, SimWorker(num_blocks=num_blocks, device="cpu"))
    trio.run(run.play, trace, swaps, clock=trio.testing.MockClock(autojump_threshold=0))

    assert sorted(run.results) == sorted(run.refs)
    for name, ref in run.refs.items():
        got = run.results[name]
        # every token computed for it was streamed, once
        assert got.finish.completion_tokens == len(got.token_ids)
        if got.finish.reason == "abort":
            assert name in run.aborted
            assert got.token_ids == ref.tokens[: len(got.token_ids)]
            assert ref.text.startswith(got.text)
        else:
            assert (got.finish.reason, got.finish.detail) == ref.finish
            assert got.token_ids == ref.tokens
            assert got.text == ref.text
    finished = run.observer.finished
    assert sorted(s.request_id for s in finished) == sorted(run.refs)
    assert sum(s.preemptions for s in finished) == len(run.observer.preempted)


@dataclass
class TraceRun:
    """Plays a trace through an engine on the simulated worker: arrivals, policy swaps,
    aborts; keeps what each request should stream and what it did."""

    config: Config
    worker: SimWorker
    engine: Engine = field(init=False)
    observer: RecordingObserver = field(default_factory=RecordingObserver)
    refs: dict[str, Reference] = field(default_factory=dict)
    results: dict[str, Collected] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    abort_at_step: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.engine = Engine(self.config, self.worker, SimTokenizer())
        self.engine.add_observer(self.observer)
        self.worker.on_plan = self.abort_as_plan_arrives

    async def play(self, trace: list[tuple], swaps: list[tuple]) -> None:
        engine = self.engine
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            async with trio.open_nursery() as clients:
                clients.start_soon(self.swap_policies, swaps)
                for i, (delay, *request) in enumerate(trace):
                    await trio.sleep(delay)
                    await self.submit(clients, i, *request)
            assert engine.state()["kv_blocks_used"] == 0
            check_invariants(engine.scheduler)
            nursery.cancel_scope.cancel()

    async def submit(self, clients, i, prompt_len, max_tokens, cut, abort_at) -> None:
        name = f"r{i}"
        prompt = [(i * 7 + k) % 120 + 1 for k in range(prompt_len)]
        stop = _cut(expected_tokens(prompt, max_tokens), cut)
        self.refs[name] = reference(prompt, max_tokens, stop)
        params = SamplingParams(max_tokens=max_tokens, stop=[stop] if stop else [], sampling=GREEDY)
        channel = await self.engine.submit(prompt, params, request_id=name)
        clients.start_soon(self.read, name, channel)
        if isinstance(abort_at, float):
            clients.start_soon(self.abort_later, name, abort_at)
        elif abort_at is not None:
            step = self.engine.scheduler.iteration + abort_at
            self.abort_at_step.setdefault(step, []).append(name)

    async def read(self, name: str, channel: trio.MemoryReceiveChannel) -> None:
        self.results[name] = await collect(channel)  # exactly one FinishEvent, then closed

    async def swap_policies(self, swaps: list[tuple]) -> None:
        for delay, (name, params) in swaps:
            await trio.sleep(delay)
            self.engine.set_policy(name, params)

    async def abort_later(self, name: str, after: float) -> None:
        await trio.sleep(after)
        self.abort(name)

    def abort_as_plan_arrives(self, plan: StepPlan) -> None:
        for name in self.abort_at_step.pop(plan.step_id, []):
            self.abort(name)

    def abort(self, name: str) -> None:
        self.aborted.add(name)
        self.engine.abort(name)


def _cut(tokens: list[int], cut: tuple[int, int] | None) -> str | None:
    if cut is None or cut[0] >= len(tokens):
        return None
    start, length = cut
    return bytes(tokens[start : start + length]).decode()


@dataclass
class SlowEngineWork(RecordingObserver):
    """Each step's own part (text, events, report) costs `cost` virtual seconds, and is
    logged into the worker's events next to its plans and results."""

    worker: SimWorker | None = None
    clock: trio.testing.MockClock | None = None
    cost: float = 0.0

    def on_iteration(self, stats: IterationStats) -> None:
        super().on_iteration(stats)
        assert self.worker is not None and self.clock is not None
        self.worker.events.append(("reported", stats.iteration))
        self.clock.jump(self.cost)


async def run_with_slow_engine_work(
    clock: trio.testing.MockClock, overlap: bool, cost: float
) -> tuple[SimWorker, SlowEngineWork]:
    worker = SimWorker()
    observer = SlowEngineWork(worker=worker, clock=clock, cost=cost)
    async with running_engine(sim_config(overlap="on" if overlap else "off"), worker) as engine:
        engine.add_observer(observer)
        channels = [
            await engine.submit([i + 1] * 20, greedy(16), request_id=f"r{i}") for i in range(3)
        ]
        for i, channel in enumerate(channels):
            assert (await collect(channel)).token_ids == expected_tokens([i + 1] * 20, 16)
    return worker, observer


async def test_the_next_plan_reaches_the_worker_before_a_step_is_reported(autojump_clock):
    cost = 0.002  # less than a step (5 ms and more): overlap can hide all of it
    worker, observer = await run_with_slow_engine_work(autojump_clock, True, cost)
    order = {event: i for i, event in enumerate(worker.events)}
    steps = [s.iteration for s in observer.iterations]
    assert len(steps) >= 16
    for k in steps[:-1]:
        assert order[("result", k)] < order[("plan", k + 1)] < order[("reported", k)]
    idle = [s.worker_idle_ms for s in observer.iterations]
    assert idle[0] is None  # the first step after an idle engine
    assert all(gap is not None and gap < cost * 1000 for gap in idle[1:])


async def test_without_overlap_the_worker_waits_for_each_report(autojump_clock):
    # the control of the test above: the same work, sequential
    cost = 0.002
    worker, observer = await run_with_slow_engine_work(autojump_clock, False, cost)
    order = {event: i for i, event in enumerate(worker.events)}
    steps = [s.iteration for s in observer.iterations]
    for k in steps[:-1]:
        assert order[("reported", k)] < order[("plan", k + 1)]
    idle = [s.worker_idle_ms for s in observer.iterations]
    assert all(gap is not None and gap >= cost * 1000 - 1e-6 for gap in idle[1:])


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_stop_string_found_while_its_next_step_runs_costs_no_extra_token(
    autojump_clock, overlap
):
    prompt = [1, 2, 3]
    tokens = expected_tokens(prompt, 40)
    text = bytes(tokens).decode()
    stop = text[6:8]
    end = text.find(stop) + len(stop)
    assert end < 40  # it ends the request mid-stream
    worker = SimWorker()
    async with running_engine(sim_config(overlap="on" if overlap else "off"), worker) as engine:
        # a neighbour that keeps running (and may take the freed blocks) after the stop
        other = await engine.submit([9] * 30, greedy(40), request_id="other")
        stopped = await engine.submit(prompt, greedy(40, stop=[stop]), request_id="stopped")
        got, kept = await collect(stopped), await collect(other)
        assert engine.state()["kv_blocks_used"] == 0
    assert got.token_ids == tokens[:end] and got.text == text[: end - len(stop)]
    assert (got.finish.detail, got.finish.completion_tokens) == ("stop_string", end)
    assert kept.token_ids == expected_tokens([9] * 30, 40)
    seq = 1
    computed = sum(seq in plan.seq_ids for plan in worker.plans)
    # with overlap, the step after the one that sampled the stop's last token was already
    # on its way when the stop was found: computed, its token ignored
    assert computed == end + overlap


@pytest.mark.parametrize("overlap", [True, False])
async def test_an_abort_while_the_next_plan_is_sent_keeps_the_committed_tokens(
    autojump_clock, overlap
):
    worker = SimWorker()
    engines: list[Engine] = []

    def abort_at_step_6(plan) -> None:
        if plan.step_id == 6:
            engines[0].abort("r")  # step 5's token is committed; with overlap not yet sent

    worker.on_plan = abort_at_step_6
    async with running_engine(sim_config(overlap="on" if overlap else "off"), worker) as engine:
        engines.append(engine)
        got = await collect(await engine.submit([1, 2], greedy(30), request_id="r"))
        assert engine.state()["kv_blocks_used"] == 0
    assert got.finish.reason == "abort"
    assert got.token_ids == expected_tokens([1, 2], 5)
    assert got.finish.completion_tokens == 5


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_worker_dying_with_a_plan_in_flight_fails_the_running_once(autojump_clock, overlap):
    worker = SimWorker(die_at_step=5)
    observer = RecordingObserver()
    config = sim_config(max_num_seqs=2, overlap="on" if overlap else "off")  # the third waits
    prompts = {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7]}
    async with running_engine(config, worker) as engine:
        engine.add_observer(observer)
        channels = {
            name: await engine.submit(prompt, greedy(12), request_id=name)
            for name, prompt in prompts.items()
        }
        got = {name: await collect(channel) for name, channel in channels.items()}
        assert engine.ready
    assert {0, 1} <= set(worker.plans[4].seq_ids)  # both were in the plan that died
    for name in ("a", "b"):
        assert (got[name].finish.reason, got[name].finish.detail) == ("error", "worker_died")
        # the four steps before the crash were all delivered
        assert got[name].token_ids == expected_tokens(prompts[name], 4)
        assert got[name].finish.completion_tokens == 4
    assert got["c"].token_ids == expected_tokens(prompts["c"], 12)
    assert sorted(s.request_id for s in observer.finished) == ["a", "b", "c"]
    assert worker.starts == 2 and worker.kills == 1


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [
        ("auto", "cpu", CPU_OVERLAP_SEQS),  # a full batch's part would take the worker's cores
        ("auto", "cuda:0", None),
        ("on", "cpu", None),
        ("off", "cuda:0", 0),
    ],
)
async def test_auto_overlaps_only_small_steps_where_the_worker_computes_on_the_cpu(
    autojump_clock, setting, device, expected
):
    worker = SimWorker(device=device)
    async with running_engine(sim_config(overlap=setting), worker) as engine:
        assert engine.state()["overlap"] == {"setting": setting, "max_seqs": expected}
        out = await collect(await engine.submit([5] * 8, greedy(6), request_id="r"))
    assert len(out.tokens) == 6
