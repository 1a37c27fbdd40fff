"""The core corrects whatever a policy decides: ids, budgets, caps, blocks, preemption."""

from __future__ import annotations

from policies.base import Decision
from service.engine.request import Request, Status
from service.engine.scheduler import Scheduler
from service.engine.step import ScheduleOutput
from tests.scheduler_helpers import SAMPLED, make_request, make_scheduler, sampled_result


def run(sched: Scheduler, decision: Decision) -> ScheduleOutput:
    """One whole iteration: the scripted decision, corrected, run, and applied."""
    sched.policy.next = decision
    out = sched.schedule(now=0.0)
    if out.plan is not None:
        sched.update(out, sampled_result(out))
    sched.blocks.check_invariants()
    return out


def decode_ready(sched: Scheduler, *requests: Request) -> None:
    """Admit and prefill requests so they are decoding (each has sampled one token)."""
    for r in requests:
        sched.add(r)
    run(sched, Decision(schedule=[(r.seq_id, r.prompt_len) for r in requests]))


def test_unknown_duplicate_and_nonpositive_entries_are_dropped():
    sched, _ = make_scheduler()
    sched.add(make_request(0, 8))
    sched.add(make_request(1, 8))
    out = run(sched, Decision(schedule=[(99, 4), (0, 4), (0, 4), (1, 0)]))
    assert [(s.request.seq_id, s.num_tokens) for s in out.scheduled] == [(0, 4)]
    assert sched.corrections["unknown_id"] == 1
    assert sched.corrections["duplicate_id"] == 1
    assert sched.corrections["nonpositive_tokens"] == 1
    assert out.plan.start_pos == [0] and not out.plan.sample[0]


def test_chunk_continues_where_the_previous_ended_and_samples_at_the_end():
    sched, _ = make_scheduler()
    a = make_request(0, 10)
    sched.add(a)
    run(sched, Decision(schedule=[(0, 4)]))
    out = run(sched, Decision(schedule=[(0, 100)]))  # more than remaining: clamped
    assert out.plan.start_pos == [4] and out.plan.num_tokens == [6] and out.plan.sample == [True]
    assert sched.corrections["tokens_over_remaining"] == 1


def test_decoding_sequence_gets_exactly_one_token():
    sched, _ = make_scheduler()
    a = make_request(0, 4)
    decode_ready(sched, a)
    out = run(sched, Decision(schedule=[(0, 5)]))
    assert out.plan.num_tokens == [1] and out.plan.start_pos == [4]
    assert out.plan.input_ids == [SAMPLED]


def test_token_budget_and_sequence_cap_hold():
    sched, _ = make_scheduler(max_tokens=10, max_seqs=2)
    reqs = [make_request(i, 8) for i in range(3)]
    for r in reqs:
        sched.add(r)
    out = run(sched, Decision(schedule=[(0, 8), (1, 8), (2, 8)]))
    assert out.plan.total_tokens == 10  # the second chunk was shortened to fit
    assert out.plan.num_tokens == [8, 2]
    assert len(out.plan.seq_ids) == 2
    assert sched.corrections["token_budget"] == 1
    assert sched.corrections["max_seqs"] == 1


def test_decodes_beyond_the_budget_wait_for_the_next_step():
    sched, _ = make_scheduler(max_tokens=3, max_seqs=8, num_blocks=32)
    reqs = [make_request(i, 3) for i in range(5)]
    for r in reqs:
        sched.add(r)
        run(sched, Decision(schedule=[(r.seq_id, 3)]))  # prefilled and sampled: decoding
    assert not sched.corrections
    out = run(sched, Decision(schedule=[(r.seq_id, 1) for r in reqs]))
    assert out.plan.seq_ids == [0, 1, 2] and out.plan.total_tokens == 3
    assert sched.corrections["token_budget"] == 2  # one per decode left out


def test_a_step_holds_exactly_the_budget():
    sched, _ = make_scheduler(max_tokens=12, max_seqs=8, num_blocks=32)
    a, b = make_request(0, 12), make_request(1, 20)
    sched.add(a)
    sched.add(b)
    out = run(sched, Decision(schedule=[(0, 12)]))  # exactly the budget: no correction
    assert out.plan.total_tokens == 12 and not sched.corrections
    out = run(sched, Decision(schedule=[(0, 1), (1, 12)]))  # one token over
    assert out.plan.num_tokens == [1, 11] and out.plan.total_tokens == 12
    assert sched.corrections["token_budget"] == 1


def test_out_of_blocks_preempts_the_most_recently_admitted_of_equal_progress():
    sched, _ = make_scheduler(num_blocks=3, block_size=4)
    a, b, c = make_request(0, 4), make_request(1, 4), make_request(2, 4)
    decode_ready(sched, a, b, c)  # each holds one full block, 4 tokens computed; none free
    out = run(sched, Decision(schedule=[(0, 1)]))
    assert [r.seq_id for r in out.preempted] == [2]
    assert c.status is Status.WAITING and c.num_computed_tokens == 0 and c.num_generated == 1
    assert sched.blocks.num_held(0) == 2


def test_policy_named_victim_is_preferred():
    sched, _ = make_scheduler(num_blocks=3, block_size=4)
    a, b, c = make_request(0, 4), make_request(1, 4), make_request(2, 4)
    decode_ready(sched, a, b, c)
    out = run(sched, Decision(schedule=[(0, 1)], preempt=[1, 77]))
    assert [r.seq_id for r in out.preempted] == [1]
    assert sched.corrections["bad_preempt_id"] == 1
    assert [r.seq_id for r in sched.waiting] == [1]


def test_admission_respects_the_watermark_and_never_evicts_by_itself():
    sched, _ = make_scheduler(num_blocks=10, block_size=4, watermark=0.2)
    a = make_request(0, 24)
    sched.add(a)
    run(sched, Decision(schedule=[(0, 24)]))  # 6 blocks; 4 free, 2 of them reserve
    b = make_request(1, 12)  # needs 3 > 4 - 2
    sched.add(b)
    out = run(sched, Decision(schedule=[(1, 12)]))
    assert b.status is Status.WAITING
    assert not out.preempted
    assert sched.corrections["admission_deferred"] >= 1


def test_empty_decision_with_work_falls_back_and_progresses():
    sched, _ = make_scheduler()
    a = make_request(0, 6)
    sched.add(a)
    out = run(sched, Decision())
    assert out.plan is not None and out.plan.seq_ids == [0]
    assert sched.corrections["empty_decision"] == 1


def test_policy_that_raises_is_contained():
    sched, policy = make_scheduler()

    def broken(view):
        raise RuntimeError("bug")

    policy.decide = broken
    sched.add(make_request(0, 6))
    out = sched.schedule(now=0.0)
    assert out.plan is not None
    assert sched.corrections["policy_raised"] == 1


def test_malformed_entries_are_rejected():
    sched, _ = make_scheduler()
    sched.add(make_request(0, 6))
    out = run(sched, Decision(schedule=[("x", None), (0,), (0, 3)]))
    assert out.plan.num_tokens == [3]
    assert sched.corrections["malformed_entry"] == 2
