"""The second half of an iteration, `Scheduler.update()`: a step's result applied.

What it owns: progress committed, the sampled token appended, EOS and max_tokens finishing
a sequence (its blocks freed at once), a worker's error failing the whole step, the
measured step handed to the next view. Driven without trio or a worker.
"""

from __future__ import annotations

import pytest

from gpu_worker.protocol import StepResult, TokenLogprobs
from policies.base import Decision
from service.engine.block_manager import BlockManager
from service.engine.invariants import check_invariants
from service.engine.request import Request, SamplingParams, SamplingSpec
from service.engine.scheduler import Scheduler
from service.engine.speculation import SpeculativeConfig, Speculator
from service.engine.step import ScheduleOutput
from tests.plan_columns import column
from tests.scheduler_helpers import Scripted, make_request
from tests.sim_worker import EOS


def scheduler(num_blocks: int = 16, **kw) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, 4),
        Scripted(),
        max_batched_tokens=64,
        max_num_seqs=8,
        eos_token_ids=[EOS],
        max_preemptions=3,
        admission_watermark=0.0,
        **kw,
    )


def planned(sched: Scheduler, decision: Decision) -> ScheduleOutput:
    sched.policy.next = decision  # type: ignore[attr-defined]
    return sched.schedule(now=0.0)


def result(out: ScheduleOutput, tokens: list[int], **kw) -> StepResult:
    """One sampled token per sequence of the step."""
    seq_ids = [item.request.seq_id for item in out.scheduled if item.samples]
    return StepResult(out.iteration, seq_ids, [[token] for token in tokens], **kw)


def test_a_worker_error_fails_every_request_of_the_step_and_frees_it():
    sched = scheduler()
    a, b = make_request(0, 4), make_request(1, 6)
    sched.add(a)
    sched.add(b)
    out = planned(sched, Decision(schedule=[(0, 4), (1, 3)]))  # b does not sample yet
    outcomes = sched.update(out, StepResult(out.iteration, error="CUDA error: boom"))
    assert [(o.request, o.finish, o.error, o.token) for o in outcomes] == [
        (a, ("error", "worker_error"), "CUDA error: boom", None),
        (b, ("error", "worker_error"), "CUDA error: boom", None),
    ]
    assert not sched.has_work() and sched.blocks.num_free == 16
    assert a.num_computed_tokens == 0 and a.num_generated == 0


def test_tokens_for_other_sequences_are_a_worker_error():
    sched = scheduler()
    a = make_request(0, 4)
    sched.add(a)
    out = planned(sched, Decision(schedule=[(0, 4)]))
    (outcome,) = sched.update(out, StepResult(out.iteration, seq_ids=[7], tokens=[[3]]))
    assert outcome.finish == ("error", "worker_error")
    assert "other sequences" in (outcome.error or "")
    assert a.num_generated == 0 and not sched.has_work()


def test_logprobs_reach_only_the_requests_that_asked():
    sched = scheduler()
    asks = make_request(0, 4)
    asks.params = SamplingParams(max_tokens=8, sampling=SamplingSpec(logprobs=True))
    plain = make_request(1, 4)
    sched.add(asks)
    sched.add(plain)
    out = planned(sched, Decision(schedule=[(0, 4), (1, 4)]))
    rows = TokenLogprobs([-0.5, -1.5], [[5, 2], []], [[-0.5, -2.0], []])
    outcomes = sched.update(out, result(out, [5, 6], logprobs=rows))
    assert [(o.token, o.logprobs) for o in outcomes] == [
        (5, TokenLogprobs([-0.5], [[5, 2]], [[-0.5, -2.0]])),
        (6, None),
    ]
    out = planned(sched, Decision(schedule=[(0, 1)]))
    (outcome,) = sched.update(out, result(out, [9]))  # the worker sent none this time
    assert (outcome.token, outcome.logprobs) == (9, None)


def test_several_tokens_of_one_step_append_in_order_until_the_sequence_finishes():
    """A step that verified drafted tokens takes several per row: each is appended with its
    own logprobs row, those past a finish are dropped, and the blocks past the accepted
    tokens go back."""
    sched = scheduler(speculator=Speculator(SpeculativeConfig()))
    short = make_request(0, 8, pattern=[1, 2, 3])
    short.params = SamplingParams(max_tokens=3, sampling=SamplingSpec(logprobs=True))
    longer = make_request(1, 8, pattern=[4, 5, 6])
    longer.params = SamplingParams(max_tokens=8, sampling=SamplingSpec(logprobs=True))
    sched.add(short)
    sched.add(longer)
    out = planned(sched, Decision(schedule=[(0, 8), (1, 8)]))
    sched.update(out, result(out, [3, 6], logprobs=TokenLogprobs([0.0, 0.0], [[], []], [[], []])))
    out = planned(sched, Decision(schedule=[(0, 1), (1, 1)]))
    assert out.plan is not None
    # one draft for `short` (its max_tokens leaves room for one and the token after it)
    assert column(out.plan, "drafts") == [[1], [4, 5, 6, 4]]
    assert sched.blocks.num_held(1) == 4  # positions up to 12: its last draft's
    rows = TokenLogprobs([-0.1, -0.2, -0.3, -0.4, -0.5], [[]] * 5, [[]] * 5)
    outcomes = sched.update(out, StepResult(out.iteration, [0, 1], [[1, 2], [4, 5, 7]], rows))
    found = [(o.request.seq_id, o.token, o.logprobs.logprobs, o.finish) for o in outcomes]
    assert found == [
        (0, 1, [-0.1], None),
        (0, 2, [-0.2], ("length", "max_tokens")),
        (1, 4, [-0.3], None),
        (1, 5, [-0.4], None),
        (1, 7, [-0.5], None),
    ]
    assert short.token_ids[-3:] == [3, 1, 2] and longer.token_ids[-4:] == [6, 4, 5, 7]
    assert sched.blocks.num_held(0) == 0
    assert longer.num_computed_tokens == 11  # its prompt's 8, its token, 2 drafts accepted
    assert sched.blocks.num_held(1) == 3  # the block of its rejected drafts went back
    assert (out.draft_tokens, out.accepted_tokens) == (5, 3)
    check_invariants(sched)


def test_more_tokens_than_a_rows_drafts_fail_the_step():
    sched = scheduler()
    request = make_request(0, 4)
    sched.add(request)
    out = planned(sched, Decision(schedule=[(0, 4)]))
    (outcome,) = sched.update(out, StepResult(out.iteration, [0], [[5, 6]]))
    assert outcome.finish == ("error", "worker_error") and "drafts" in (outcome.error or "")
    assert sched.blocks.num_free == 16


def echo_request(seq_id: int, prompt_len: int) -> Request:
    request = make_request(seq_id, prompt_len, family=0)
    request.params = SamplingParams(max_tokens=8, sampling=SamplingSpec(prompt_logprobs=2))
    request.prompt_logprobs = TokenLogprobs()
    return request


def fake_prompt_logprobs(targets: list[int]) -> TokenLogprobs:
    """What a worker would say of `targets`: each one's logprob is minus its token id."""
    return TokenLogprobs(
        [-float(t) for t in targets], [[t] for t in targets], [[0.0]] * len(targets)
    )


def run_chunk(sched: Scheduler, seq_id: int, tokens: int, sampled: list[int]) -> ScheduleOutput:
    out = planned(sched, Decision(schedule=[(seq_id, tokens)]))
    assert out.plan is not None
    found = [
        None if t is None else fake_prompt_logprobs(t) for t in column(out.plan, "prompt_targets")
    ]
    sched.update(out, result(out, sampled, prompt_logprobs=found))
    return out


def test_prompt_targets_follow_the_chunks_and_stop_before_the_sampled_position():
    sched = scheduler()
    request = echo_request(0, 10)
    sched.add(request)
    prompt = list(request.token_ids)
    first = run_chunk(sched, 0, 4, [])
    assert first.plan is not None and column(first.plan, "prompt_targets") == [prompt[1:5]]
    last = run_chunk(sched, 0, 6, [7])
    assert last.plan is not None and column(last.plan, "prompt_targets") == [prompt[5:10]]
    assert request.prompt_logprobs == fake_prompt_logprobs(prompt[1:])
    decode = planned(sched, Decision(schedule=[(0, 1)]))
    assert (
        decode.plan is not None and column(decode.plan, "prompt_targets") == []
    )  # nobody wants any


def test_a_preempted_echo_request_keeps_each_prompt_logprob_once():
    sched = scheduler()
    request = echo_request(0, 10)
    sched.add(request)
    prompt = list(request.token_ids)
    run_chunk(sched, 0, 6, [])
    sched.rules.preempt(request, ScheduleOutput(0, "test", None))
    run_chunk(sched, 0, 10, [7])
    assert request.prompt_logprobs == fake_prompt_logprobs(prompt[1:])


def test_an_echo_request_computes_its_prompt_even_when_it_is_cached():
    sched = scheduler()
    first = make_request(0, 12, family=0)
    sched.add(first)
    planned_out = planned(sched, Decision(schedule=[(0, 12)]))
    sched.update(planned_out, result(planned_out, [7]))
    echo = echo_request(1, 12)  # the same prompt, whose first two blocks are cached
    sched.add(echo)
    out = planned(sched, Decision(schedule=[(1, 12)]))
    assert echo.num_cached_tokens == 0
    assert out.plan is not None and out.plan.start_pos == [0]
    assert column(out.plan, "prompt_targets") == [echo.token_ids[1:12]]
    later = make_request(2, 12, family=0)  # asks for no logprobs: it takes the hit
    sched.add(later)
    out = planned(sched, Decision(schedule=[(2, 12)]))
    assert later.num_cached_tokens == 8


@pytest.mark.parametrize(
    ("ignore_eos", "max_tokens", "tokens", "finish"),
    [
        (False, 8, [EOS], ("stop", "eos")),
        (True, 8, [EOS], None),
        (False, 1, [5], ("length", "max_tokens")),
        (False, 1, [EOS], ("stop", "eos")),  # both: EOS says why
        (False, 2, [5], None),
    ],
)
def test_eos_and_length_finish_a_sequence_and_free_its_blocks(
    ignore_eos, max_tokens, tokens, finish
):
    sched = scheduler()
    r = make_request(0, 4)
    r.params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    sched.add(r)
    out = planned(sched, Decision(schedule=[(0, 4)]))
    (outcome,) = sched.update(out, result(out, tokens))
    assert outcome.token == tokens[0] and r.token_ids[-1] == tokens[0]
    assert outcome.finish == finish
    assert sched.has_work() == (finish is None)
    assert sched.blocks.num_held(0) == (0 if finish else 1)


def test_the_measured_step_and_the_iteration_reach_the_next_view_and_stats():
    sched = scheduler()
    first = sched.build_view(0.0)
    assert (first.iteration, first.last_step_ms, first.last_step_tokens) == (0, None, 0)
    r = make_request(0, 4)
    sched.add(r)
    out = planned(sched, Decision(schedule=[(0, 3)]))
    sched.update(out, result(out, [], step_ms=12.5))
    view = sched.build_view(1.0)
    assert (view.iteration, view.last_step_ms, view.last_step_tokens) == (1, 12.5, 3)
    stats = sched.stats()
    assert (stats.iteration, stats.running, stats.waiting) == (1, 1, 0)
    assert (stats.kv_blocks_used, stats.kv_blocks_total) == (1, 16)


def test_policies_see_a_bounded_window_of_the_queue_in_arrival_order():
    sched = scheduler(num_blocks=512)
    for seq_id in range(300, 0, -1):
        sched.add(make_request(seq_id, 2))
    view = sched.build_view(0.0)
    assert [s.seq_id for s in view.waiting] == list(range(1, 257))  # the default window
    assert view.num_waiting == 300
    small = scheduler(waiting_view=3)
    for seq_id in range(5):
        small.add(make_request(seq_id, 2))
    assert [s.seq_id for s in small.build_view(0.0).waiting] == [0, 1, 2]


def test_fresh_blocks_after_a_worker_restart_only_when_nothing_runs():
    sched = scheduler()
    r = make_request(0, 4)
    sched.add(r)
    out = planned(sched, Decision(schedule=[(0, 4)]))
    sched.update(out, result(out, [5], step_ms=3.0))
    with pytest.raises(AssertionError, match="running"):
        sched.replace_blocks(BlockManager(32, 4))
    sched.remove(r)
    sched.replace_blocks(BlockManager(32, 4))
    assert sched.stats().kv_blocks_total == 32
    assert sched.build_view(0.0).last_step_ms is None  # the old worker's timing is gone
