"""Admission that counts the whole prompt, and preemption that cannot storm.

The rules are the scheduler's (service/engine/block_rules.py): a waiting sequence is admitted
only if blocks for its whole prompt fit beside those promised to prefills still running;
after a preemption nobody is admitted until the unpromised free blocks exceed
`admission_watermark`; victims go by least progress lost and never beyond
`max_preemptions`; a request at the cap is readmitted only if its whole life fits beside
the others at the cap, so nothing deadlocks. The examples pin each rule; the property runs
random traces through the real policies, with aborts, to the end.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import Decision
from policies.registry import POLICIES, make_policy
from service.engine.invariants import check_invariants
from service.engine.request import Request, Status
from service.engine.scheduler import Scheduler
from service.engine.step import ScheduleOutput
from tests.scheduler_helpers import SAMPLED, make_request, make_scheduler, sampled_result


def step(sched: Scheduler, decision: Decision) -> ScheduleOutput:
    """One iteration with a scripted decision, checked and applied; a request that reaches
    max_tokens is marked finished, as the engine does."""
    sched.policy.next = decision  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    if out.plan is not None:
        for outcome in sched.update(out, sampled_result(out)):
            if outcome.finish is not None:
                outcome.request.status = Status.FINISHED
    check_invariants(sched)
    return out


def scheduled(out: ScheduleOutput) -> list[tuple[int, int]]:
    return [(s.request.seq_id, s.num_tokens) for s in out.scheduled]


def preempted(out: ScheduleOutput) -> list[int]:
    return [r.seq_id for r in out.preempted]


def admit_all(sched: Scheduler, *requests: Request) -> None:
    """Admit and prefill `requests` in one step: each samples one token and then decodes."""
    for r in requests:
        sched.add(r)
    out = step(sched, Decision(schedule=[(r.seq_id, r.prompt_len) for r in requests]))
    assert scheduled(out) == [(r.seq_id, r.prompt_len) for r in requests]


# ---- admission counts the whole prompt --------------------------------------------------


def test_a_prompt_whose_later_chunks_would_not_fit_is_not_admitted_on_its_first():
    sched, _ = make_scheduler(num_blocks=8, block_size=4, max_tokens=64)
    a = make_request(0, 16)
    admit_all(sched, a)  # 4 blocks; its next decode takes a fifth
    b = make_request(1, 20)  # 5 blocks in all, 1 for a first chunk of 4 tokens
    sched.add(b)
    out = step(sched, Decision(schedule=[(0, 1), (1, 4)]))
    assert scheduled(out) == [(0, 1)] and b.status is Status.WAITING
    assert sched.blocks.num_free == 3 and sched.corrections == {"admission_deferred": 1}
    sched.remove(a)
    out = step(sched, Decision(schedule=[(1, 4)]))
    assert scheduled(out) == [(1, 4)]
    assert sched.blocks.num_held(1) == 1 and sched.blocks.num_promised == 4


def test_two_long_prompts_are_not_admitted_against_the_same_blocks():
    sched, _ = make_scheduler(num_blocks=10, block_size=4, max_tokens=64)
    a, b = make_request(0, 24), make_request(1, 24)  # 6 blocks each
    sched.add(a)
    sched.add(b)
    out = step(sched, Decision(schedule=[(0, 4), (1, 4)]))
    # 9 blocks are free, but 5 of them are promised to a's remaining chunks
    assert scheduled(out) == [(0, 4)] and b.status is Status.WAITING
    assert (sched.blocks.num_free, sched.blocks.num_promised) == (9, 5)
    for _ in range(5):
        step(sched, Decision(schedule=[(0, 4), (1, 4)]))  # a's chunks keep the promise
    assert a.num_computed_tokens == 24 and a.num_generated == 1
    assert sched.blocks.num_promised == 0 and b.status is Status.WAITING
    assert not sched.corrections.keys() - {"admission_deferred"}
    sched.remove(a)
    out = step(sched, Decision(schedule=[(1, 4)]))
    assert scheduled(out) == [(1, 4)]


def test_a_preempted_sequence_needs_room_for_its_prompt_and_its_generated_tokens():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a, b = make_request(0, 8, max_tokens=20), make_request(1, 4, max_tokens=20)
    admit_all(sched, a, b)  # a holds 2 blocks, b 1: one free
    for _ in range(3):
        step(sched, Decision(schedule=[(1, 1)]))  # b: 7 tokens, 2 blocks, none free
    out = step(sched, Decision(schedule=[(0, 1)]))  # a needs a third block: b goes
    assert preempted(out) == [1] and b.num_tokens == 8
    sched.remove(a)  # 4 free again; b must recompute 8 tokens (2 blocks), not 4
    out = step(sched, Decision(schedule=[(1, 4)]))
    assert scheduled(out) == [(1, 4)] and sched.blocks.num_promised == 1


# ---- hysteresis -------------------------------------------------------------------------


def test_after_a_preemption_nobody_is_admitted_until_blocks_exceed_the_higher_watermark():
    # 12 blocks; admission resumes above 5 free and unpromised
    sched, _ = make_scheduler(num_blocks=12, block_size=4, max_tokens=64, admission_watermark=0.45)
    assert sched.rules.admission_watermark_blocks == 5
    a, b, c, e = (make_request(i, n, max_tokens=30) for i, n in enumerate((12, 11, 15, 7)))
    admit_all(sched, a, b, c, e)  # 3 + 3 + 4 + 2 blocks: none free
    out = step(sched, Decision(schedule=[(0, 1)]))  # a needs a fourth block: e goes
    assert preempted(out) == [3] and sched.blocks.num_free == 1 and sched.rules.admission_paused
    assert sched.build_view(0.0).admit_blocks == 0  # the policies see the pause too
    newcomer = make_request(4, 3)  # one block: it would fit
    sched.add(newcomer)
    out = step(sched, Decision(schedule=[(4, 3), (0, 1)]))
    assert scheduled(out) == [(0, 1)] and sched.corrections["admission_paused"] == 1
    sched.remove(c)
    assert sched.blocks.num_available == 5 and sched.rules.admission_paused  # at it, not above
    out = step(sched, Decision(schedule=[(4, 3), (0, 1)]))
    assert scheduled(out) == [(0, 1)] and sched.corrections["admission_paused"] == 2
    sched.remove(b)
    assert sched.blocks.num_available == 8 and not sched.rules.admission_paused
    assert sched.build_view(0.0).admit_blocks == 8 - sched.blocks.watermark_blocks
    out = step(sched, Decision(schedule=[(4, 3), (0, 1)]))
    assert scheduled(out) == [(4, 3), (0, 1)]


def test_the_pause_lasts_the_rest_of_the_step_and_ends_when_blocks_are_back():
    sched, _ = make_scheduler(num_blocks=10, block_size=4, max_tokens=64, admission_watermark=0.1)
    a, b, c = make_request(0, 12), make_request(1, 12), make_request(2, 16)
    admit_all(sched, a, b, c)  # 3 + 3 + 4 blocks
    newcomer = make_request(3, 4)
    sched.add(newcomer)
    out = step(sched, Decision(schedule=[(0, 1), (3, 4)]))
    # a's growth evicts b (3 blocks, 1 used): 2 free, but not for anyone in this step
    assert preempted(out) == [1] and scheduled(out) == [(0, 1)]
    assert sched.corrections["admission_paused"] == 1
    out = step(sched, Decision(schedule=[(3, 4)]))  # 2 > 1 at the next step: resumed
    assert scheduled(out) == [(3, 4)] and not sched.rules.admission_paused


# ---- victims ----------------------------------------------------------------------------


def test_the_victim_is_the_one_with_least_progress_ties_to_the_most_recently_admitted():
    sched, _ = make_scheduler(num_blocks=12, block_size=4, max_tokens=64)
    c, d, a, b = make_request(2, 8), make_request(3, 8), make_request(0, 12), make_request(1, 20)
    for r in (c, d, a, b):  # admitted in this order; b, the latest, has most progress
        admit_all(sched, r)
    assert sched.blocks.num_free == 0
    out = step(sched, Decision(schedule=[(0, 1)]))  # a needs a fourth block
    assert preempted(out) == [3]  # c and d lose 8 tokens each, d came later
    assert scheduled(out) == [(0, 1)]


def test_a_request_at_the_cap_is_never_a_victim_and_a_named_one_is_refused():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, max_tokens=64, max_preemptions=1)
    a, b, c = make_request(0, 4), make_request(1, 3), make_request(2, 4)
    b.preemptions = 1  # at the cap
    admit_all(sched, a, b, c)  # one block each; a's next token needs another
    out = step(sched, Decision(schedule=[(0, 1)], preempt=[1]))
    assert sched.corrections["preempt_cap"] == 1  # the policy named b: refused
    assert preempted(out) == [2]  # b has least progress, but c is the one under the cap
    assert b.status is Status.RUNNING and scheduled(out) == [(0, 1)]


def test_with_every_other_sequence_at_the_cap_a_sequence_waits_rather_than_evict():
    sched, _ = make_scheduler(num_blocks=2, block_size=4, max_tokens=64, max_preemptions=1)
    a, b = make_request(0, 4, max_tokens=2), make_request(1, 3, max_tokens=2)
    b.preemptions = 1
    admit_all(sched, a, b)
    out = step(sched, Decision(schedule=[(0, 1)]))
    # a cannot grow and may not evict b; the fallback runs b, which finishes and frees
    assert not out.preempted and scheduled(out) == [(1, 1)]
    assert sched.corrections["no_blocks"] == 2 and b.is_finished
    out = step(sched, Decision(schedule=[(0, 1)]))
    assert scheduled(out) == [(0, 1)] and a.is_finished


def test_a_request_at_the_cap_is_readmitted_only_if_its_whole_life_fits_beside_the_kept():
    # 8 blocks of 4. Requests at the cap cannot be evicted: all of them together must be
    # able to reach max_tokens, or they could all be stuck needing a block.
    sched, _ = make_scheduler(num_blocks=8, block_size=4, max_tokens=64, max_preemptions=1)
    kept = make_request(0, 4, max_tokens=12)  # 16 tokens at most: 4 blocks
    kept.preemptions = 1
    admit_all(sched, kept)
    late = make_request(1, 4, max_tokens=17)  # 21 tokens: 6 blocks, 4 + 6 > 8
    late.preemptions = 1
    fresh = make_request(2, 4, max_tokens=17)  # the same size, under the cap
    sched.add(late)
    sched.add(fresh)
    out = step(sched, Decision(schedule=[(1, 4), (2, 4)]))
    assert scheduled(out) == [(2, 4)] and late.status is Status.WAITING
    assert sched.corrections["admission_deferred"] == 1
    sched.remove(kept)
    out = step(sched, Decision(schedule=[(1, 4)]))
    assert scheduled(out) == [(1, 4)]


# ---- the property -----------------------------------------------------------------------


def arrivals(capacity: int) -> st.SearchStrategy[list[tuple[int, int, int, int, int | None]]]:
    """Requests of up to half of what one may hold (validation's limit), in a burst."""
    size = st.integers(1, max(1, capacity // 2))
    return st.lists(
        st.tuples(
            st.integers(0, 1),  # steps after the previous arrival
            size,  # prompt length
            size,  # max_tokens
            st.integers(0, 3),  # priority
            # aborted this many steps after arrival, a quarter of them
            st.one_of(st.none(), st.none(), st.none(), st.integers(0, 60)),
        ),
        min_size=4,
        max_size=14,
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    policy=st.sampled_from(sorted(POLICIES)),
    num_blocks=st.integers(6, 16),
    block_size=st.integers(1, 4),
    budget=st.integers(4, 48),
    max_seqs=st.integers(2, 6),
    max_preemptions=st.sampled_from([0, 1, 1, 2, 3]),
    watermarks=st.sampled_from([(0.0, 0.0), (0.0, 0.2), (0.1, 0.3), (0.2, 0.5)]),
)
def test_random_traces_finish_without_storm_or_deadlock(
    data: st.DataObject,
    policy: str,
    num_blocks: int,
    block_size: int,
    budget: int,
    max_seqs: int,
    max_preemptions: int,
    watermarks: tuple[float, float],
):
    watermark, admission_watermark = watermarks
    sched, _ = make_scheduler(
        num_blocks,
        block_size,
        budget,
        max_seqs,
        watermark,
        admission_watermark=admission_watermark,
        max_preemptions=max_preemptions,
    )
    sched.policy = make_policy(policy)
    trace = data.draw(arrivals(sched.capacity_tokens), label="trace")
    arrivals_at: list[tuple[int, Request, int | None]] = []
    at = 0
    for i, (gap, prompt, max_new, priority, abort_after) in enumerate(trace):
        at += gap
        request = make_request(i, prompt, max_tokens=max_new, priority=priority)
        arrivals_at.append((at, request, None if abort_after is None else at + abort_after))
    work = sum(p + n for _, p, n, _, _ in trace) * (1 + max_preemptions)
    bound = at + work + 1  # each step computes a token of someone's life, or waits for one
    preemptions = {r.seq_id: 0 for _, r, _ in arrivals_at}
    aborted: set[int] = set()
    for iteration in range(bound):
        for arrival, request, _ in arrivals_at:
            if arrival == iteration:
                sched.add(request)
        if not sched.has_work():
            if iteration >= at:
                break
            continue
        out = sched.schedule(now=float(iteration))
        assert out.plan is not None, "work was pending but nothing ran (deadlock)"
        for victim in out.preempted:
            preemptions[victim.seq_id] += 1
        for _, request, abort_at in arrivals_at:  # aborted while the step runs
            if abort_at == iteration and not request.is_finished:
                sched.remove(request)
                request.status = Status.FINISHED
                aborted.add(request.seq_id)
        for outcome in sched.update(out, sampled_result(out)):
            if outcome.finish is not None:
                assert outcome.finish == ("length", "max_tokens")
                outcome.request.status = Status.FINISHED
        check_invariants(sched)
        assert max(preemptions.values()) <= max_preemptions
    else:
        raise AssertionError(f"not done after {bound} steps")
    assert sched.blocks.num_free == num_blocks and sched.blocks.num_promised == 0
    for _, request, _ in arrivals_at:
        assert request.is_finished
        assert request.preemptions == preemptions[request.seq_id] <= max_preemptions
        if request.seq_id not in aborted:
            assert request.num_generated == request.params.max_tokens
            assert request.token_ids[request.prompt_len :] == [SAMPLED] * request.num_generated


# ---- a slot at the sequence cap, for the policy's admission ------------------------------


def test_at_the_sequence_cap_a_victim_the_policy_names_gives_up_its_slot():
    sched, _ = make_scheduler(num_blocks=16, block_size=4, max_tokens=64, max_seqs=2)
    minor, other = make_request(0, 4, priority=5), make_request(1, 4, priority=5)
    admit_all(sched, minor, other)
    urgent = make_request(2, 4, priority=0)
    sched.add(urgent)
    out = step(sched, Decision(schedule=[(0, 1), (2, 4)]))  # nobody named: the cap holds
    assert scheduled(out) == [(0, 1)] and sched.corrections["max_seqs"] == 1
    out = step(sched, Decision(schedule=[(0, 1), (2, 4)], preempt=[1]))
    assert preempted(out) == [1] and scheduled(out) == [(0, 1), (2, 4)]
    assert not sched.rules.admission_paused  # a slot, not blocks: admission goes on
    assert other.status is Status.WAITING and other.num_computed_tokens == 0
