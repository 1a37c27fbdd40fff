"""The scheduler with a draft model (speculative decoding, method draft_model): a decode
asks the worker for DRAFT_MODEL_TOKEN drafts and sends the draft model the context it
lacks, in pieces where a step cannot take it all; what the draft model holds follows the
worker's verdicts, and a preempted request sends it all again."""

from __future__ import annotations

from gpu_worker.protocol import DRAFT_MODEL_TOKEN, StepResult
from policies.base import Decision
from service.engine.invariants import check_invariants
from service.engine.request import Request, SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.speculation import DRAFT_MODEL, SpeculativeConfig
from service.engine.step import ScheduleOutput
from tests.plan_columns import column
from tests.scheduler_helpers import make_request, make_scheduler

K = 3
SPEC = SpeculativeConfig(method=DRAFT_MODEL, num_speculative_tokens=K, model="draft")


def scheduler(**kw) -> Scheduler:
    kw = {"num_blocks": 32, "block_size": 4, "max_tokens": 64, "max_seqs": 8, **kw}
    sched, _ = make_scheduler(speculative=SPEC, **kw)
    return sched


def plan(sched: Scheduler, schedule: list[tuple[int, int]]) -> ScheduleOutput:
    sched.policy.next = Decision(schedule=schedule)  # type: ignore[attr-defined]
    return sched.schedule(now=0.0)


def answer(out: ScheduleOutput, tokens: dict[int, list[int]]) -> StepResult:
    ids = [item.request.seq_id for item in out.scheduled if item.samples]
    return StepResult(out.iteration, ids, [tokens[i] for i in ids])


def decoding(sched: Scheduler, seq_id: int = 0, prompt: int = 9) -> Request:
    """A request prefilled, its first token (7) sampled: it decodes next."""
    request = make_request(seq_id, prompt, max_tokens=32)
    request.params = SamplingParams(max_tokens=32)
    sched.add(request)
    out = plan(sched, [(seq_id, prompt)])
    assert out.plan is not None and not column(
        out.plan, "draft_context"
    )  # a prefill sends it nothing
    sched.update(out, answer(out, {seq_id: [7]}))
    return request


def test_a_first_draft_sends_the_whole_context_and_asks_for_k_drafts():
    sched = scheduler()
    request = decoding(sched)
    out = plan(sched, [(0, 1)])
    assert out.plan is not None
    assert column(out.plan, "drafts") == [[DRAFT_MODEL_TOKEN] * K]
    assert out.plan.input_ids == [7] + [DRAFT_MODEL_TOKEN] * K
    assert column(out.plan, "draft_context") == [request.token_ids[:9]]
    assert [row.draft_start for row in out.plan.rows] == [0]


def test_what_the_draft_model_holds_follows_the_verdicts():
    sched = scheduler()
    request = decoding(sched)
    out = plan(sched, [(0, 1)])
    sched.update(out, answer(out, {0: [11, 12, 13]}))  # 2 of 3 drafts kept, then 13
    # its cache took positions 9 (the token 7) and 10, 11 (drafts 1 and 2): all kept
    assert request.num_computed_tokens == 12 and sched.plans.draft_synced(request.seq_id) == 12
    out = plan(sched, [(0, 1)])
    assert out.plan is not None and not column(out.plan, "draft_context")  # nothing is missing
    sched.update(out, answer(out, {0: [21, 22, 23, 24]}))  # all 3 kept, then 24
    # the last draft (23, at 15) was never read by the draft model: it is sent next
    assert request.num_computed_tokens == 16 and sched.plans.draft_synced(request.seq_id) == 15
    out = plan(sched, [(0, 1)])
    assert out.plan is not None
    assert column(out.plan, "draft_context") == [[23]] and [
        row.draft_start for row in out.plan.rows
    ] == [15]
    sched.update(out, answer(out, {0: [31]}))  # every draft rejected
    assert sched.plans.draft_synced(request.seq_id) == 17
    check_invariants(sched)


def test_an_accepted_draft_is_the_worker_s_choice():
    sched = scheduler()
    request = decoding(sched)
    out = plan(sched, [(0, 1)])
    outcomes = sched.update(out, answer(out, {0: [5, 6]}))
    assert [o.token for o in outcomes] == [5, 6]
    assert request.token_ids[9:] == [7, 5, 6]
    assert (request.acceptance.drafted, request.acceptance.accepted) == (K, 1)


def test_a_context_too_long_for_one_step_goes_in_pieces_before_any_draft():
    # before the cost model is fitted a decode-only step takes at most 16 tokens
    sched = scheduler(num_blocks=64, max_tokens=256)
    request = decoding(sched, prompt=40)
    sent: list[int] = []
    for _ in range(3):
        out = plan(sched, [(0, 1)])
        assert out.plan is not None
        if column(out.plan, "drafts"):
            break
        (context,) = column(out.plan, "draft_context")
        assert [row.draft_start for row in out.plan.rows] == [len(sent)] and 0 < len(context) <= 16
        sent += context
        sched.update(out, answer(out, {0: [9]}))
        assert sched.plans.draft_synced(request.seq_id) == len(sent)
    else:
        raise AssertionError("the context never arrived")
    assert column(out.plan, "draft_context") == [
        request.token_ids[len(sent) : request.num_computed_tokens]
    ]
    assert sent == request.token_ids[: len(sent)]


def test_a_preempted_request_sends_its_context_again():
    sched = scheduler()
    request = decoding(sched)
    out = plan(sched, [(0, 1)])
    sched.update(out, answer(out, {0: [1]}))
    assert sched.plans.draft_synced(request.seq_id) == 10
    sched.rules.preempt(request, ScheduleOutput(0, "test", None))
    assert sched.plans.draft_synced(request.seq_id) == 0
