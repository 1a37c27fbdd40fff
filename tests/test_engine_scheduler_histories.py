"""The engine's half of the worker's histories, and of the sampling facts it adds.

A sequence whose sampling reads its tokens is introduced with its first plan after each
admission (the prompt length, and the tokens a prefix-cache hit skips) and is finished by
the first plan after it ends or is preempted; a sequence that reads none never appears in
either. stop_token_ids finish a sequence; min_tokens holds back EOS and those tokens
(unless ignore_eos), and bad words reach the worker as token sequences.
"""

from __future__ import annotations

import dataclasses

from gpu_worker.protocol import SamplingSpec
from policies.base import Decision
from service.engine.request import Request, SamplingParams, Status
from service.engine.sampling import worker_sampling
from service.engine.scheduler import Scheduler
from service.engine.step import STOP_TOKEN, ScheduleOutput
from tests.scheduler_helpers import SAMPLED, make_request, make_scheduler, sampled_result
from tests.sim_worker import EOS, SimTokenizer

PENALISED = SamplingSpec(temperature=0.5, frequency_penalty=0.5)


def reading(request: Request) -> Request:
    request.params = dataclasses.replace(request.params, sampling=PENALISED)
    return request


def step(sched: Scheduler, schedule: list[tuple[int, int]]) -> ScheduleOutput:
    sched.policy.next = Decision(schedule=schedule)  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    assert out.plan is not None
    for outcome in sched.update(out, sampled_result(out)):
        if outcome.finish is not None:
            outcome.request.status = Status.FINISHED
    return out


def test_a_history_begins_with_the_first_plan_and_is_released_after_the_end():
    sched, _ = make_scheduler(num_blocks=16)
    free, penalised = make_request(0, 4), reading(make_request(1, 5, max_tokens=2))
    sched.add(free)
    sched.add(penalised)
    first = step(sched, [(0, 4), (1, 5)]).plan
    assert first is not None
    assert [(n.seq_id, n.prompt_len, n.prefix) for n in first.new] == [(0, 4, []), (1, 5, [])]
    assert first.new[1].sampling.reads_history
    second = step(sched, [(0, 1), (1, 1)]).plan  # penalised reaches max_tokens
    assert second is not None and (second.new, second.finished) == ([], [])
    third = step(sched, [(0, 1)]).plan
    assert third is not None and third.finished == [1]
    assert step(sched, [(0, 1)]).plan.finished == []  # type: ignore[union-attr]


def test_a_prefix_cache_hit_sends_the_tokens_it_skips():
    sched, _ = make_scheduler(num_blocks=16, block_size=4, prefix_caching=True)
    sched.add(make_request(0, 9, family=3))
    step(sched, [(0, 9)])
    later = reading(make_request(1, 9, family=3))
    sched.add(later)
    plan = step(sched, [(1, 9)]).plan
    assert plan is not None and plan.start_pos == [8]
    assert [(n.prompt_len, n.prefix) for n in plan.new] == [(9, later.token_ids[:8])]


def test_a_preempted_sequence_is_released_and_begins_again_on_readmission():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a, b = make_request(0, 8, max_tokens=20), reading(make_request(1, 4, max_tokens=20))
    sched.add(a)
    sched.add(b)
    step(sched, [(0, 8), (1, 4)])
    for _ in range(3):
        step(sched, [(1, 1)])  # b: 7 tokens in 2 blocks, none free
    out = step(sched, [(0, 1)])  # a needs a third block: b is preempted
    assert [r.seq_id for r in out.preempted] == [1]
    assert out.plan is not None and out.plan.finished == [1]  # the same step's plan
    sched.remove(a)
    plan = step(sched, [(1, 8)]).plan
    assert plan is not None and [(n.seq_id, n.prefix) for n in plan.new] == [(1, [])]
    assert plan.finished == [0]


def test_a_stop_token_finishes_the_sequence():
    sched, _ = make_scheduler()
    request = make_request(0, 4)
    request.params.stop_token_ids = [SAMPLED]
    sched.add(request)
    sched.policy.next = Decision(schedule=[(0, 4)])  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    [outcome] = sched.update(out, sampled_result(out))
    assert (outcome.token, outcome.finish) == (SAMPLED, STOP_TOKEN)
    assert not sched.has_work()


def test_min_tokens_holds_back_eos_and_the_stop_tokens_unless_eos_is_ignored():
    encode = SimTokenizer().encode
    params = SamplingParams(stop_token_ids=[5, 9], sampling=SamplingSpec(min_tokens=3))
    assert worker_sampling(params, encode, [EOS]).sampling.min_tokens_stop_ids == [5, 9, EOS]
    params.ignore_eos = True
    assert worker_sampling(params, encode, [EOS]).sampling.min_tokens_stop_ids == [5, 9]
    assert worker_sampling(SamplingParams(), encode, [EOS]) == SamplingParams()


def test_bad_words_become_token_sequences_with_and_without_a_leading_space():
    def encode(text: str) -> list[int]:  # a word and its spaced form are one token each
        return {"darn": [40], " darn": [41], "oh no": [7, 8], " oh no": [9, 8, 10]}[text]

    params = SamplingParams(bad_words=[" darn", "oh no"])
    assert worker_sampling(params, encode, []).sampling.bad_words == [[40], [41], [7, 8]]
    assert params.sampling.bad_words == []  # the client's params are not changed
