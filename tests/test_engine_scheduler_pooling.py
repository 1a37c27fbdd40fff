"""The scheduler's half of embeddings (pooled requests): what each chunk asks the worker
to pool, nothing sampled, the finish with the step that computes the prompt's last token,
the mean over every row, no prefix-cache hit for a mean, and a sum that starts again after
a preemption."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np

from gpu_worker.protocol import POOL_LAST, POOL_SUM, SamplingSpec, StepPlan, StepResult
from policies.base import Decision
from service.engine.request import LAST_POOLING, MEAN_POOLING, Request, Status
from service.engine.scheduler import Scheduler
from service.engine.step import POOLED, Outcome, ScheduleOutput
from tests.scheduler_helpers import make_request, make_scheduler, sampled_result


def pooled(request: Request, kind: str) -> Request:
    request.params = dataclasses.replace(
        request.params, max_tokens=0, pooling=kind, sampling=SamplingSpec()
    )
    return request


def worker_answer(out: ScheduleOutput) -> StepResult:
    """As the worker pools: a chunk's vector is [its first position, its token count] (a
    sum of rows adds up their counts, which the mean then divides by the prompt length)."""
    assert out.plan is not None
    result = sampled_result(out)
    plan = out.plan
    pooled = [item.request.params.pooling is not None for item in out.scheduled]
    if any(pooled):
        result.pooled = [
            _encoded([float(start), float(count)]) if pools else None
            for pools, start, count in zip(pooled, plan.start_pos, plan.num_tokens, strict=True)
        ]
    return result


def _encoded(values: list[float]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f8").tobytes()).decode()


def step(
    sched: Scheduler, schedule: list[tuple[int, int]], preempt: tuple[int, ...] = ()
) -> tuple[StepPlan, list[Outcome]]:
    sched.policy.next = Decision(schedule, list(preempt))  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    assert out.plan is not None
    outcomes = sched.update(out, worker_answer(out))
    for outcome in outcomes:
        if outcome.finish is not None:
            outcome.request.status = Status.FINISHED
    return out.plan, outcomes


def test_a_mean_pools_every_chunk_samples_nothing_and_ends_with_its_last_chunk():
    sched, _ = make_scheduler(num_blocks=16, block_size=4, max_tokens=32)
    request = pooled(make_request(0, 10), MEAN_POOLING)
    sched.add(request)
    plan, outcomes = step(sched, [(0, 4)])
    assert ([n.pooling for n in plan.new], plan.sample, outcomes) == ([POOL_SUM], [False], [])
    assert step(sched, [(0, 4)])[1] == []
    _, [outcome] = step(sched, [(0, 2)])
    assert outcome.finish == POOLED and outcome.token is None
    # starts 0 + 4 + 8 and counts 4 + 4 + 2, over 10 tokens
    assert request.pooled == [12 / 10, 10 / 10]
    assert sched.blocks.num_free == 16  # its blocks are back


def test_a_last_token_pool_is_asked_of_the_final_chunk_only_and_takes_the_cache_hit():
    sched, _ = make_scheduler(num_blocks=16, block_size=4, prefix_caching=True)
    sched.add(make_request(0, 9, family=1, max_tokens=1))
    step(sched, [(0, 9)])  # its 2 full blocks are cached
    last = pooled(make_request(1, 11, family=1), LAST_POOLING)
    sched.add(last)
    plan, [outcome] = step(sched, [(1, 3)])  # the hit covers 8 of its 11 tokens
    assert [n.pooling for n in plan.new] == [POOL_LAST]
    assert last.num_cached_tokens == 8 and last.pooled == [8.0, 3.0]
    assert outcome.finish == POOLED
    mean = pooled(make_request(2, 11, family=1), MEAN_POOLING)
    sched.add(mean)
    step(sched, [(2, 11)])  # every row is summed: no hit
    assert mean.num_cached_tokens == 0 and mean.pooled == [0.0, 1.0]


def test_a_preempted_mean_starts_its_sum_again():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_tokens=32)
    request = pooled(make_request(0, 8), MEAN_POOLING)
    other = make_request(1, 8, max_tokens=16)
    sched.add(other)
    sched.add(request)
    step(sched, [(1, 8), (0, 4)])  # 2 blocks, and 1 of the mean's 2
    for _ in range(6):  # the other decodes through its third block, then wants a fourth
        step(sched, [(1, 1)], preempt=(0,))
        if request.status is Status.WAITING:
            break
    assert request.status is Status.WAITING and request.num_computed_tokens == 0
    sched.remove(other)
    step(sched, [(0, 4)])
    _, [outcome] = step(sched, [(0, 4)])
    assert outcome.finish == POOLED
    assert request.pooled == [4 / 8, 8 / 8]  # the first chunk counted once, not twice
