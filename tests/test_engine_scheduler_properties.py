"""Property tests of the Scheduler under arbitrary policy decisions.

The scheduler's promise (service/engine/scheduler.py) is that whatever a policy returns, a step
never holds more than `max_batched_tokens` tokens or `max_num_seqs` sequences, a decoding
sequence computes exactly one token, a chunk continues at `num_computed`, blocks come from
free ones only, and a preempted sequence goes back to waiting to be recomputed. Here
hypothesis scripts the decisions (good, bad and malformed ids, any token counts, any
preemption lists) over many iterations, with the engine's part (sampling a token, finishing
a request) simulated, and checks every promise after every step. The example-based tests
below pin the individual rules the properties cannot state exactly.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import Decision, View
from service.engine.block_manager import BlockManager
from service.engine.invariants import check_invariants
from service.engine.request import Request, Status
from service.engine.scheduler import Scheduler
from service.engine.step import ScheduleOutput
from tests.plan_columns import HeldTables
from tests.scheduler_helpers import (
    SAMPLED,
    make_request,
    make_scheduler,
    sampled_result,
)


def step(sched: Scheduler, decision: Decision) -> ScheduleOutput:
    """One whole iteration: schedule with `decision`, then apply the worker's result."""
    sched.policy.next = decision  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    if out.plan is not None:
        sched.update(out, sampled_result(out))
    return out


def scheduled(out: ScheduleOutput) -> list[tuple[int, int]]:
    return [(s.request.seq_id, s.num_tokens) for s in out.scheduled]


# ---- the property -----------------------------------------------------------------------


@dataclass
class Before:
    """What a request looked like when the step was planned."""

    num_computed: int
    num_tokens: int
    status: Status
    preemptions: int
    token_ids: list[int] = field(default_factory=list)


def token_counts() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-2, 3), st.integers(4, 80))


@st.composite
def decisions(draw: st.DrawFn, known: list[int]) -> Decision:
    ids = st.sampled_from(known) if known else st.just(0)
    any_id = st.one_of(ids, ids, ids, st.integers(-1, 60))
    entry = st.one_of(
        st.tuples(any_id, token_counts()),
        st.tuples(any_id, token_counts()),
        st.tuples(any_id, token_counts()),
        st.sampled_from([("x", 1), (None, 2), (1,), (1, 2, 3), (1, "many")]),
    )
    return Decision(
        schedule=draw(st.lists(entry, max_size=8)),
        preempt=draw(st.lists(st.one_of(ids, st.integers(-1, 60), st.just("x")), max_size=3)),
    )


_HELD: weakref.WeakKeyDictionary[Scheduler, HeldTables] = weakref.WeakKeyDictionary()


def _held_by_worker(sched: Scheduler) -> HeldTables:
    """What the worker of `sched` holds: the plans checked so far, applied."""
    if sched not in _HELD:
        _HELD[sched] = HeldTables(sched.blocks.num_groups)
    return _HELD[sched]


def check_step(
    sched: Scheduler, out: ScheduleOutput, before: dict[int, Before], block_size: int
) -> None:
    plan = out.plan
    if not out.scheduled:
        assert plan is None
        return
    assert plan is not None
    held = _held_by_worker(sched)
    held.apply(plan)
    assert plan.total_tokens == sum(plan.num_tokens) <= sched.max_batched_tokens
    assert len(plan.seq_ids) <= sched.max_num_seqs
    assert len(set(plan.seq_ids)) == len(plan.seq_ids)
    assert plan.seq_ids == [s.request.seq_id for s in out.scheduled]
    assert out.decode_seqs + out.prefill_tokens > 0
    assert out.prefill_tokens + out.decode_seqs == plan.total_tokens
    offset = 0
    for i, item in enumerate(out.scheduled):
        seq_id, n, start = plan.seq_ids[i], plan.num_tokens[i], plan.start_pos[i]
        was = before[seq_id]
        request = item.request
        assert n == item.num_tokens >= 1
        if was.status is Status.WAITING:
            # admitted: from its cached prefix, whole blocks, never past its last token
            assert start % block_size == 0 and start < was.num_tokens
            assert start == 0 or sched.blocks.enable_caching
        else:  # a chunk continues where the cache ends
            assert start == was.num_computed
        tables = held.tables[seq_id]
        written = [b for table in tables for b in table[start // block_size :]]
        assert all(sched.blocks.refcount(b) == 1 for b in written), "writes a shared block"
        assert start + n <= was.num_tokens
        if was.num_tokens - was.num_computed == 1:
            assert n == 1  # decoding: exactly one token
        assert plan.sample[i] == (start + n == was.num_tokens)
        assert plan.input_ids[offset : offset + n] == was.token_ids[start : start + n]
        offset += n
        # the table covers exactly the tokens computed so far
        assert len(tables[0]) == -(-(start + n) // block_size)
        assert tables == [sched.blocks.table(seq_id, g) for g in range(sched.blocks.num_groups)]
        assert request.status is Status.RUNNING
        assert held.introduced[seq_id].sampling is request.params.sampling
        assert request not in out.preempted
    assert offset == plan.total_tokens


def check_preempted(sched: Scheduler, out: ScheduleOutput, before: dict[int, Before]) -> None:
    for victim in out.preempted:
        was = before[victim.seq_id]
        assert was.status is Status.RUNNING
        assert victim.status is Status.WAITING and victim.num_computed_tokens == 0
        assert victim.preemptions == was.preemptions + 1
        assert victim in sched.waiting and victim not in sched.running
        assert sched.blocks.num_held(victim.seq_id) == 0
        assert victim.token_ids == was.token_ids  # generated tokens are kept
    assert len({v.seq_id for v in out.preempted}) == len(out.preempted)


def check_membership(sched: Scheduler, live: dict[int, Request]) -> None:
    assert [r.seq_id for r in sched.waiting] == sorted(r.seq_id for r in sched.waiting)
    assert {r.seq_id for r in sched.running} | {r.seq_id for r in sched.waiting} == set(live)
    assert not {r.seq_id for r in sched.running} & {r.seq_id for r in sched.waiting}
    assert all(r.status is Status.RUNNING for r in sched.running)
    assert all(r.status is Status.WAITING for r in sched.waiting)
    assert len(sched.running) <= sched.max_num_seqs
    orders = [r.admitted_order for r in sched.running]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    for r in sched.waiting:
        assert sched.blocks.num_held(r.seq_id) == 0 and r.num_computed_tokens == 0
    for r in sched.running:
        assert r.num_computed_tokens <= r.num_tokens
        blocks = -(-r.num_computed_tokens // sched.blocks.block_size)
        if any(sched.blocks.windows):  # a windowed group gave back what lies behind
            assert sched.blocks.num_held(r.seq_id) <= blocks * sched.blocks.num_groups
        else:
            assert sched.blocks.num_held(r.seq_id) == blocks
    check_invariants(sched)  # the blocks', the promises', the cap's
    assert sched.has_work() == bool(live)


# Long on purpose (PLR0915): one trace, every promise after every step
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(4, 24),
    block_size=st.integers(1, 6),
    max_tokens=st.integers(1, 40),
    max_seqs=st.integers(1, 5),
    watermark=st.sampled_from([0.0, 0.0, 0.1, 0.25]),
    admission_watermark=st.sampled_from([0.0, 0.3]),
    max_preemptions=st.integers(0, 3),
    steps=st.integers(1, 25),
    prefix_caching=st.booleans(),
    groups=st.sampled_from([("full",), ("full",), ("full", "w", "w"), ("w",)]),
    window=st.integers(1, 12),
)
def test_every_step_keeps_the_core_promises_whatever_the_policy_decides(  # noqa: PLR0915
    data: st.DataObject,
    num_blocks: int,
    block_size: int,
    max_tokens: int,
    max_seqs: int,
    watermark: float,
    admission_watermark: float,
    max_preemptions: int,
    steps: int,
    prefix_caching: bool,
    groups: tuple[str, ...],
    window: int,
):
    """On one table per sequence, and on a hybrid model's KV groups (a full group and
    windowed ones, or a windowed one alone)."""
    sched, policy = make_scheduler(
        num_blocks,
        block_size,
        max_tokens,
        max_seqs,
        watermark,
        admission_watermark=admission_watermark,
        max_preemptions=max_preemptions,
        prefix_caching=prefix_caching,
    )
    if groups != ("full",):
        windows = [None if kind == "full" else window for kind in groups]
        sched.replace_blocks(
            BlockManager(
                num_blocks,
                block_size,
                watermark,
                enable_caching=prefix_caching,
                windows=windows,
                max_chunk_tokens=max_tokens,
            )
        )
    capacity = min(sched.capacity_tokens, 1000)
    live: dict[int, Request] = {}
    next_id = 0
    for iteration in range(1, steps + 1):
        for _ in range(data.draw(st.integers(0, 2), label="arrivals")):
            max_new = data.draw(st.integers(1, 6), label="max_tokens")
            if capacity - max_new < 1:
                continue
            prompt = data.draw(st.integers(1, min(capacity - max_new, 60)), label="prompt")
            family = data.draw(st.integers(0, 2), label="prompt family")  # shared prefixes
            request = make_request(next_id, prompt, max_tokens=max_new, family=family)
            sched.add(request)
            live[next_id] = request
            next_id += 1
        if data.draw(st.booleans(), label="script a decision"):
            decision = data.draw(decisions(sorted(live)), label="decision")
        else:
            decision = Decision()  # the fallback decides
        before = {
            seq_id: Before(
                r.num_computed_tokens, r.num_tokens, r.status, r.preemptions, list(r.token_ids)
            )
            for seq_id, r in live.items()
        }
        had_work = sched.has_work()
        running, waiting = [r.seq_id for r in sched.running], [r.seq_id for r in sched.waiting]
        # what the view's blocks_for must say: a decode's next block in every group; a
        # newcomer's admission (without a cache hit: with one, the view counts its shares)
        growth = {
            r.seq_id: sched.blocks.extra_blocks(r.seq_id, r.num_tokens) for r in sched.running
        }
        admission = {r.seq_id: sched.blocks.admission_cost(r.num_tokens) for r in sched.waiting}
        free = sched.blocks.num_free
        policy.next = decision
        out = sched.schedule(now=float(iteration))
        view = policy.views[-1]  # what the policy saw
        assert [s.seq_id for s in view.running] == running
        assert [s.seq_id for s in view.waiting] == waiting and view.num_waiting == len(waiting)
        assert view.free_blocks == free and view.now == float(iteration)
        for s in view.running:
            assert view.blocks_for(s, s.remaining) == growth[s.seq_id]
        for s in view.waiting:
            assert s.num_computed_tokens or view.blocks_for(s, s.remaining) == admission[s.seq_id]
        assert out.iteration == view.iteration == iteration
        check_step(sched, out, before, block_size)
        check_preempted(sched, out, before)
        if had_work:  # a preemption is made only for a sequence that then runs
            assert out.plan is not None, "work was pending but nothing ran"
        # a request aborted while the step runs (the engine removes it at once)
        if out.scheduled and data.draw(st.integers(0, 9), label="abort") == 0:
            gone = out.scheduled[0].request
            sched.remove(gone)
            gone.status = Status.FINISHED
            del live[gone.seq_id]
        outcomes = sched.update(out, sampled_result(out)) if out.plan is not None else []
        finished = {o.request.seq_id for o in outcomes if o.finish == ("length", "max_tokens")}
        for k, item in enumerate(out.scheduled):
            request = item.request
            was = before[request.seq_id]
            assert out.plan is not None
            start = out.plan.start_pos[k]  # where it was (an admission: its cache hit)
            if request.is_finished:  # aborted: nothing applied
                assert request.num_computed_tokens == start
                assert request.token_ids == was.token_ids
                continue
            assert request.num_computed_tokens == start + item.num_tokens
            if item.samples:
                assert request.token_ids == [*was.token_ids, SAMPLED]
                done = request.num_generated >= request.params.max_tokens
                assert (request.seq_id in finished) == done
                if done:  # finished and freed by update(); the engine marks it
                    request.status = Status.FINISHED
                    del live[request.seq_id]
            else:
                assert request.token_ids == was.token_ids
        check_membership(sched, live)
    for request in list(live.values()):
        sched.remove(request)
    assert sched.blocks.num_free == num_blocks and not sched.has_work()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    max_tokens=st.integers(1, 32),
    max_seqs=st.integers(1, 4),
)
def test_the_fallback_alone_finishes_every_request(
    prompts: list[int], max_tokens: int, max_seqs: int
):
    """A policy that never decides anything still gets every request done (liveness)."""
    sched, _ = make_scheduler(num_blocks=12, block_size=4, max_tokens=max_tokens, max_seqs=max_seqs)
    requests = [make_request(i, p, max_tokens=3) for i, p in enumerate(prompts)]
    for r in requests:
        sched.add(r)
    for _ in range(400):
        if not sched.has_work():
            break
        out = step(sched, Decision())
        assert out.plan is not None
        sched.blocks.check_invariants()
        for r in [s.request for s in out.scheduled if s.samples]:
            if r.num_generated >= 3:
                sched.remove(r)
                r.status = Status.FINISHED
    assert not sched.has_work()
    assert all(r.num_generated == 3 for r in requests)
    assert sched.blocks.num_free == 12


# ---- the rules, one by one --------------------------------------------------------------


def test_membership_add_and_remove_keep_arrival_order_and_free_blocks():
    sched, _ = make_scheduler()
    for seq_id in (3, 1, 2):
        sched.add(make_request(seq_id, 4))
    assert [r.seq_id for r in sched.waiting] == [1, 2, 3]
    assert sched.has_work()
    out = step(sched, Decision(schedule=[(2, 4)]))
    assert scheduled(out) == [(2, 4)]
    two = out.scheduled[0].request
    assert sched.blocks.num_held(2) == 1
    sched.remove(two)
    assert sched.blocks.num_held(2) == 0 and sched.blocks.num_free == 16
    assert two not in sched.running
    sched.remove(two)  # twice: nothing happens
    sched.remove(make_request(99, 4))  # never added: nothing happens
    assert [r.seq_id for r in sched.waiting] == [1, 3]
    for r in list(sched.waiting):
        sched.remove(r)
    assert not sched.has_work() and not sched.waiting


def test_view_describes_each_sequence_and_the_limits():
    sched, _ = make_scheduler(num_blocks=10, block_size=4, max_tokens=20, max_seqs=3)
    a = make_request(0, 6, tenant="acme", priority=5, received=1.5)
    b = make_request(1, 3, tenant="zeta", priority=-1, received=2.5)
    sched.add(a)
    sched.add(b)
    sched.policy.next = Decision(schedule=[(0, 6)])  # type: ignore[attr-defined]
    out = sched.schedule(now=1.0)
    sched.update(out, sampled_result(out, step_ms=3.25))  # a is prefilled and samples
    view = sched.build_view(12.5)
    assert (view.iteration, view.now, view.last_step_ms, view.last_step_tokens) == (
        1,
        12.5,
        3.25,
        6,
    )
    assert (view.free_blocks, view.total_blocks, view.block_size) == (8, 10, 4)
    assert (view.max_batched_tokens, view.max_seqs) == (20, 3)
    (ra,) = view.running
    (wb,) = view.waiting
    assert (ra.seq_id, ra.tenant, ra.priority, ra.arrival) == (0, "acme", 5, 1.5)
    assert (ra.prompt_len, ra.num_generated, ra.num_computed_tokens) == (6, 1, 6)
    assert ra.num_blocks == 2
    assert ra.preempted == 0 and ra.is_decoding and ra.remaining == 1
    assert (wb.seq_id, wb.tenant, wb.priority, wb.arrival) == (1, "zeta", -1, 2.5)
    assert (wb.prompt_len, wb.num_generated, wb.num_computed_tokens) == (3, 0, 0)
    assert wb.num_blocks == 0
    assert wb.remaining == 3 and not wb.is_decoding


def test_a_preempted_sequence_is_seen_as_preempted_and_recomputed_from_zero():
    sched, _ = make_scheduler(num_blocks=2, block_size=4)
    a, b = make_request(0, 4), make_request(1, 4)
    sched.add(a)
    sched.add(b)
    step(sched, Decision(schedule=[(0, 4), (1, 4)]))  # both hold their one full block
    out = step(sched, Decision(schedule=[(0, 1)]))  # a needs a second block: b goes
    assert [r.seq_id for r in out.preempted] == [1]
    view = sched.build_view(0.0)
    (wb,) = view.waiting
    assert wb.preempted == 1 and wb.num_computed_tokens == 0 and wb.num_generated == 1
    assert wb.remaining == 5  # prompt and its generated token are recomputed together
    sched.remove(a)
    out = step(sched, Decision(schedule=[(1, 5)]))
    assert scheduled(out) == [(1, 5)]
    assert out.plan.start_pos == [0] and out.plan.sample == [True]
    assert out.plan.input_ids == b.token_ids[:5]


def test_decision_is_applied_in_the_policy_order():
    sched, _ = make_scheduler(max_tokens=64)
    for i in range(3):
        sched.add(make_request(i, 4))
    out = step(sched, Decision(schedule=[(2, 4), (0, 4), (1, 4)]))
    assert out.plan.seq_ids == [2, 0, 1]
    assert [r.seq_id for r in sched.running] == [2, 0, 1]  # admission order


def test_prefill_and_decode_counts_split_the_step():
    sched, _ = make_scheduler(max_tokens=64)
    a, b = make_request(0, 4), make_request(1, 10)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 4)]))
    sched.add(b)
    out = step(sched, Decision(schedule=[(0, 1), (1, 6)]))
    assert out.decode_seqs == 1 and out.prefill_tokens == 6
    assert out.plan.sample == [True, False]


def test_a_prefill_chunk_is_shortened_to_the_budget_left_but_a_decode_is_not_split():
    sched, _ = make_scheduler(max_tokens=5, max_seqs=4)
    a, b, c = make_request(0, 4), make_request(1, 4), make_request(2, 9)
    for r in (a, b):
        sched.add(r)
    step(sched, Decision(schedule=[(0, 4)]))
    step(sched, Decision(schedule=[(1, 4)]))  # a and b now decode
    sched.add(c)
    out = step(sched, Decision(schedule=[(2, 4), (0, 1), (1, 1)]))
    assert scheduled(out) == [(2, 4), (0, 1)]  # b's one token does not fit: skipped
    assert sched.corrections["token_budget"] == 1
    out = step(sched, Decision(schedule=[(0, 1), (1, 1), (2, 9)]))
    assert scheduled(out) == [(0, 1), (1, 1), (2, 3)]  # the chunk takes what is left
    out = step(sched, Decision(schedule=[(2, 9), (0, 1)]))
    assert scheduled(out) == [(2, 2), (0, 1)]  # c had only 2 left: no correction needed


def test_a_budget_exactly_used_up_takes_nothing_more():
    sched, _ = make_scheduler(max_tokens=8)
    for i in range(2):
        sched.add(make_request(i, 8))
    out = step(sched, Decision(schedule=[(0, 8), (1, 8)]))
    assert scheduled(out) == [(0, 8)]
    assert out.plan.total_tokens == 8


def test_the_sequence_cap_counts_running_sequences_for_admission():
    sched, _ = make_scheduler(max_seqs=2, max_tokens=64)
    for i in range(3):
        sched.add(make_request(i, 4))
    step(sched, Decision(schedule=[(0, 4), (1, 4)]))
    out = step(sched, Decision(schedule=[(2, 4)]))  # 2 running already: 2 cannot join
    assert scheduled(out) != [(2, 4)]
    assert sched.waiting[0].seq_id == 2
    assert sched.corrections["max_seqs"] >= 1
    # the fallback ran the two running decodes instead
    assert sorted(scheduled(out)) == [(0, 1), (1, 1)]


def test_a_waiting_sequence_is_admitted_exactly_when_its_blocks_fit_above_the_watermark():
    # 10 blocks, watermark 2: admission may use 8 blocks in all
    sched, _ = make_scheduler(num_blocks=10, block_size=4, watermark=0.2, max_tokens=64)
    a, b = make_request(0, 20), make_request(1, 12)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 20)]))  # 5 blocks: 5 free, 3 above the watermark
    sched.add(b)
    out = step(sched, Decision(schedule=[(1, 12)]))  # exactly 3 blocks: fits
    assert (1, 12) in scheduled(out)
    assert not out.preempted


def test_a_waiting_sequence_one_block_over_the_watermark_waits():
    sched, _ = make_scheduler(num_blocks=10, block_size=4, watermark=0.2, max_tokens=64)
    a, b = make_request(0, 20), make_request(1, 13)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 20)]))
    sched.add(b)
    out = step(sched, Decision(schedule=[(1, 13)]))  # 4 blocks > 3
    assert b.status is Status.WAITING and (1, 13) not in scheduled(out)
    assert sched.corrections["admission_deferred"] >= 1
    assert scheduled(out) == [(0, 1)]  # the fallback ran a: 6 blocks, 2 above the watermark
    out = step(sched, Decision(schedule=[(1, 8)]))  # its first chunk fits, its prompt does not
    assert b.status is Status.WAITING and scheduled(out) == [(0, 1)]


def test_policy_victims_make_room_for_a_newcomer_in_the_order_named():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, max_tokens=64)
    reqs = [make_request(i, 4) for i in range(3)]
    for r in reqs:
        sched.add(r)
    step(sched, Decision(schedule=[(0, 4), (1, 4), (2, 4)]))  # no block free
    newcomer = make_request(3, 8)
    sched.add(newcomer)
    out = step(sched, Decision(schedule=[(3, 8)], preempt=[2, 0, 1]))
    assert [r.seq_id for r in out.preempted] == [2, 0]  # two blocks needed, two victims
    assert scheduled(out) == [(3, 8)]
    assert reqs[1].status is Status.RUNNING


def test_policy_victims_already_scheduled_this_step_are_spared():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, max_tokens=64)
    reqs = [make_request(i, 4) for i in range(3)]
    for r in reqs:
        sched.add(r)
    step(sched, Decision(schedule=[(0, 4), (1, 4), (2, 4)]))
    newcomer = make_request(3, 4)
    sched.add(newcomer)
    out = step(sched, Decision(schedule=[(0, 1), (3, 4)], preempt=[0, 1, 0]))
    # 0 is named twice and also scheduled: 1 is the victim; 0 needed its own room first
    assert sched.corrections["bad_preempt_id"] == 1
    assert all(r.seq_id != 0 for r in out.preempted)
    assert (0, 1) in scheduled(out)


def test_a_newcomer_never_evicts_running_work_without_named_victims():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, max_tokens=64)
    a, b = make_request(0, 8), make_request(1, 8)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 8)]))  # 2 blocks held, 1 free
    sched.add(b)
    out = step(sched, Decision(schedule=[(1, 8)]))  # b needs 2
    assert not out.preempted and b.status is Status.WAITING
    assert scheduled(out) == [(0, 1)]  # the fallback kept a going in the free block


def test_a_sequence_preempted_in_this_step_cannot_come_back_in_it():
    sched, _ = make_scheduler(num_blocks=2, block_size=4, max_tokens=64)
    a, b = make_request(0, 4), make_request(1, 4)
    sched.add(a)
    sched.add(b)
    step(sched, Decision(schedule=[(0, 4), (1, 4)]))
    out = step(sched, Decision(schedule=[(0, 1), (1, 5)]))  # a grows: b goes, then asks back
    assert [r.seq_id for r in out.preempted] == [1]
    assert scheduled(out) == [(0, 1)]
    assert sched.corrections["scheduled_after_preempt"] == 1


def test_a_running_sequence_with_no_one_to_preempt_is_skipped():
    sched, _ = make_scheduler(num_blocks=1, block_size=4, max_tokens=64)
    a = make_request(0, 4)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 4)]))  # the only block, full
    sched.policy.next = Decision(schedule=[(0, 1)])  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    assert out.plan is None  # a needs a second block that does not exist
    assert sched.corrections["no_blocks"] >= 1 and a.status is Status.RUNNING


def test_of_equal_progress_the_default_victim_is_the_most_recently_admitted_other_one():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, max_tokens=64)
    reqs = [make_request(i, 4) for i in range(3)]
    for r in reqs:
        sched.add(r)
    for seq_id in (2, 1, 0):  # admitted in the reverse of arrival order
        step(sched, Decision(schedule=[(seq_id, 4)]))
    assert sched.blocks.num_free == 0
    out = step(sched, Decision(schedule=[(1, 1)]))  # 1 needs a second block
    assert [r.seq_id for r in out.preempted] == [0]  # admitted last, though it arrived first
    assert scheduled(out) == [(1, 1)]


def test_a_scheduled_sequence_is_never_the_default_victim():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, max_tokens=64)
    reqs = [make_request(i, 4) for i in range(3)]
    for r in reqs:
        sched.add(r)
    step(sched, Decision(schedule=[(0, 4), (1, 4), (2, 4)]))  # one full block each
    out = step(sched, Decision(schedule=[(2, 1), (0, 1)]))
    # 2 grows by preempting 1 (equal progress: the most recent other); then 0 would need a
    # block, but the only other running sequence, 2, is already in this step
    assert [r.seq_id for r in out.preempted] == [1]
    assert scheduled(out) == [(2, 1)]
    assert sched.corrections["no_blocks"] == 1


def test_update_skips_requests_that_finished_during_the_step():
    sched, _ = make_scheduler()
    a, b = make_request(0, 4), make_request(1, 4)
    sched.add(a)
    sched.add(b)
    sched.policy.next = Decision(schedule=[(0, 4), (1, 4)])  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    sched.remove(a)
    a.status = Status.FINISHED
    outcomes = sched.update(out, sampled_result(out))
    assert [o.request for o in outcomes] == [b]
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 4
    assert a.token_ids == a.token_ids[: a.prompt_len] and b.num_generated == 1
    assert sched.blocks.num_held(0) == 0


def test_the_fallback_runs_running_sequences_before_waiting_ones():
    sched, _ = make_scheduler(max_tokens=6, max_seqs=4)
    a, b = make_request(0, 4), make_request(1, 10)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 4)]))
    sched.add(b)
    out = step(sched, Decision())
    assert scheduled(out) == [(0, 1), (1, 5)]
    assert sched.corrections["empty_decision"] == 1


def test_an_idle_scheduler_plans_nothing_and_records_no_correction():
    sched, _ = make_scheduler()
    out = step(sched, Decision(schedule=[(5, 3)]))
    assert out.plan is None and out.scheduled == [] and out.preempted == []
    assert sched.corrections["empty_decision"] == 0


def test_plan_carries_step_id_positions_tokens_and_sampling():
    sched, _ = make_scheduler(max_tokens=64)
    a = make_request(0, 6)
    sched.add(a)
    sched.policy.next = Decision(schedule=[(0, 6)])  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    assert out.plan.step_id == out.iteration == 1
    assert out.plan.input_ids == a.token_ids
    assert [row.blocks for row in out.plan.rows] == [[sched.blocks.table(0)]]
    assert [new.sampling for new in out.plan.new] == [a.params.sampling]


@pytest.mark.parametrize("tokens", [0, -1, -100])
def test_nonpositive_token_counts_schedule_nothing(tokens: int):
    sched, _ = make_scheduler()
    sched.add(make_request(0, 4))
    sched.add(make_request(1, 4))
    out = step(sched, Decision(schedule=[(0, tokens), (1, 2)]))
    assert scheduled(out) == [(1, 2)]
    assert sched.corrections["nonpositive_tokens"] == 1


def test_string_ids_and_counts_that_are_numbers_are_accepted():
    sched, _ = make_scheduler()
    sched.add(make_request(0, 4))
    out = step(sched, Decision(schedule=[("0", "3")]))  # type: ignore[list-item]
    assert scheduled(out) == [(0, 3)]
    assert not sched.corrections


def test_a_bad_preempt_entry_is_counted_and_ignored():
    sched, _ = make_scheduler()
    a, b = make_request(0, 4), make_request(1, 4)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 4)]))
    sched.add(b)
    out = step(sched, Decision(schedule=[(0, 1)], preempt=["0", 1, 42, 0, 0]))  # type: ignore[list-item]
    # "0" is not an int, 1 is waiting, 42 unknown, the second 0 a repeat; 0 itself was
    # named but scheduled, so nobody is preempted
    assert sched.corrections["bad_preempt_id"] == 4
    assert not out.preempted and scheduled(out) == [(0, 1)]


def test_an_entry_refused_after_a_preemption_does_not_end_the_step():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, max_tokens=64)
    a, b, c = make_request(0, 4), make_request(1, 4), make_request(2, 3)
    for r in (a, b, c):
        sched.add(r)
    step(sched, Decision(schedule=[(0, 4), (1, 4), (2, 3)]))  # one block each, none free
    out = step(sched, Decision(schedule=[(0, 1), (1, 5), (2, 1)], preempt=[1]))
    # a grows by evicting b; b cannot come back; c still decodes in its own block
    assert [r.seq_id for r in out.preempted] == [1]
    assert scheduled(out) == [(0, 1), (2, 1)]


def test_an_entry_without_room_does_not_end_the_step():
    sched, _ = make_scheduler(num_blocks=6, block_size=4, max_tokens=64)
    e, held = make_request(0, 4, max_tokens=20), make_request(1, 3, max_tokens=20)
    sched.add(e)
    sched.add(held)
    step(sched, Decision(schedule=[(0, 4), (1, 3)]))  # both decode, one block each
    a = make_request(2, 16)
    sched.add(a)
    step(sched, Decision(schedule=[(2, 4)]))  # admitted on 4 free blocks: 3 promised
    for _ in range(5):
        step(sched, Decision(schedule=[(0, 1)]))  # e grows into 2 of the promised blocks
    assert sched.blocks.num_free == 1 and sched.blocks.num_promised == 3
    out = step(sched, Decision(schedule=[(0, 1), (2, 12), (1, 1)]))
    # a is 2 blocks short and the only sequence it may preempt holds 1: nobody goes
    assert scheduled(out) == [(0, 1), (1, 1)]
    assert not out.preempted and sched.corrections["no_blocks"] == 1


def test_a_deferred_admission_does_not_end_the_step():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a = make_request(0, 4)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 4)]))  # a decodes in its block; 3 free
    big, small = make_request(1, 16), make_request(2, 8)
    sched.add(big)
    sched.add(small)
    out = step(sched, Decision(schedule=[(0, 1), (1, 16), (2, 8)]))
    assert scheduled(out) == [(0, 1), (2, 8)]  # big needs 4 blocks; small's 2 fit
    assert big.status is Status.WAITING


def test_preempt_entries_of_any_type_are_checked_not_trusted():
    sched, _ = make_scheduler(num_blocks=2, block_size=4, max_tokens=64)
    a, b = make_request(0, 4), make_request(1, 4)
    sched.add(a)
    sched.add(b)
    step(sched, Decision(schedule=[(0, 4), (1, 4)]))  # both blocks taken
    junk: list = [[1], {1: 1}, 1.0, None, "1"]
    out = step(sched, Decision(schedule=[(0, 1)], preempt=junk))
    assert sched.corrections["bad_preempt_id"] == len(junk)
    # none of them named b: a grows by the default rule, which takes b anyway
    assert [r.seq_id for r in out.preempted] == [1]


def test_the_sequence_asking_for_room_is_never_its_own_victim():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, max_tokens=64)
    reqs = [make_request(i, 4) for i in range(3)]
    for r in reqs:
        sched.add(r)
    for seq_id in (0, 1, 2):
        step(sched, Decision(schedule=[(seq_id, 4)]))
    out = step(sched, Decision(schedule=[(2, 1)], preempt=[2]))  # the newest, naming itself
    assert sched.corrections["bad_preempt_id"] == 0  # running, so a well-formed id
    assert [r.seq_id for r in out.preempted] == [1]  # equal progress: the most recent *other* one
    assert scheduled(out) == [(2, 1)] and reqs[2].status is Status.RUNNING


@pytest.mark.parametrize(
    ("decision", "kind"),
    [
        (Decision(schedule=[(98, 1), (99, 1), (0, 1)]), "unknown_id"),
        (Decision(schedule=[(0, 1), (0, 1), (0, 1)]), "duplicate_id"),
        (Decision(schedule=[(0, 0), (0, -1), (0, 1)]), "nonpositive_tokens"),
        (Decision(schedule=[("a", 1), (None,), (0, 1)]), "malformed_entry"),
        (Decision(schedule=[(0, 9), (1, 9)]), "tokens_over_remaining"),
        (Decision(schedule=[(0, 1)], preempt=[98, 99]), "bad_preempt_id"),
    ],
)
def test_every_correction_is_counted_each_time(decision: Decision, kind: str):
    """The scheduler's `corrections` promise: every fix is counted, so tests can see it."""
    sched, _ = make_scheduler()
    sched.add(make_request(0, 4))
    sched.add(make_request(1, 4))
    step(sched, Decision(schedule=[(0, 4), (1, 4)]))  # both decode from now on
    step(sched, decision)
    assert sched.corrections == {kind: 2}


def test_repeated_fixes_over_steps_add_up():
    sched, policy = make_scheduler(max_seqs=2, max_tokens=64)
    for i in range(3):
        sched.add(make_request(i, 4))

    def broken(view: View) -> Decision:
        raise RuntimeError("policy bug")

    policy.decide = broken  # type: ignore[method-assign]
    for _ in range(2):
        sched.schedule(now=0.0)
    # each step: the policy raised, the empty decision fell back, the third sequence
    # found the step full (max_seqs) and could not be admitted either
    assert sched.corrections["policy_raised"] == 2
    assert sched.corrections["empty_decision"] == 2


def test_a_full_running_set_is_counted_at_admission_and_in_the_step():
    sched, _ = make_scheduler(max_seqs=2, max_tokens=64)
    for i in range(4):
        sched.add(make_request(i, 4))
    step(sched, Decision(schedule=[(0, 4), (1, 4)]))
    step(sched, Decision(schedule=[(2, 4), (3, 4)]))
    # two admissions refused (2 running) -> fallback: 0 and 1 decode, then 2 and 3 each
    # find the step full
    assert sched.corrections == {"max_seqs": 4, "empty_decision": 1}


def test_entries_after_the_step_is_full_are_still_checked():
    sched, _ = make_scheduler(max_seqs=2, max_tokens=64)
    for i in range(3):
        sched.add(make_request(i, 4))
    out = step(sched, Decision(schedule=[(0, 4), (1, 4), (2, 4), (99, 1), (0, 1)]))
    assert scheduled(out) == [(0, 4), (1, 4)]
    assert sched.corrections == {"max_seqs": 1, "unknown_id": 1, "duplicate_id": 1}


def test_each_deferred_admission_and_each_missing_block_is_counted():
    sched, _ = make_scheduler(num_blocks=1, block_size=4, max_tokens=64)
    a, b, c = make_request(0, 4), make_request(1, 4), make_request(2, 4)
    sched.add(a)
    step(sched, Decision(schedule=[(0, 4)]))  # the only block, full
    sched.add(b)
    sched.add(c)
    sched.policy.next = Decision()  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    assert out.plan is None
    # the fallback tried a (no block to grow into), then b and c (no block to admit into)
    assert sched.corrections == {"empty_decision": 1, "no_blocks": 1, "admission_deferred": 2}
    sched.policy.next = Decision(schedule=[(0, 1)])  # type: ignore[attr-defined]
    sched.schedule(now=0.0)
    assert sched.corrections["no_blocks"] == 3  # once by the policy's entry, once by fallback


def test_each_entry_shortened_to_the_budget_is_counted():
    sched, _ = make_scheduler(max_tokens=6, max_seqs=4)
    for i in range(3):
        sched.add(make_request(i, 4))
    out = step(sched, Decision(schedule=[(0, 4), (1, 4), (2, 4)]))
    assert scheduled(out) == [(0, 4), (1, 2)]
    assert sched.corrections == {"token_budget": 2}  # 1 shortened, 2 dropped


def test_a_repeat_after_preemption_is_counted_each_time():
    sched, _ = make_scheduler(num_blocks=2, block_size=4, max_tokens=64)
    a, b = make_request(0, 4), make_request(1, 4)
    sched.add(a)
    sched.add(b)
    step(sched, Decision(schedule=[(0, 4), (1, 4)]))
    step(sched, Decision(schedule=[(0, 1), (1, 5), (1, 5)]))
    assert sched.corrections["scheduled_after_preempt"] == 2
