"""The scheduler's side of a consumer's pulls, step by step: a receiving request waits for
blocks in arrival order, is never offered to the policy while its K/V is on the move, and
one that ends mid-pull keeps its blocks until the worker reports the pull done (the pull
still writes them)."""

from __future__ import annotations

import dataclasses

from gpu_worker.protocol import PullDone, StepResult
from service.engine.invariants import check_invariants
from service.engine.kv_transfer import RemoteKv
from service.engine.request import Request, Status
from tests.scheduler_helpers import make_request, make_scheduler


def receiving(seq_id: int, prompt_len: int) -> Request:
    request = make_request(seq_id, prompt_len)
    remote = RemoteKv(f"t{seq_id}", "e", "local", 1, [[0] * -(-prompt_len // 4)], [], 9, prompt_len)
    request.params = dataclasses.replace(request.params, remote_kv=remote)
    return request


def test_pulls_wait_for_blocks_and_no_policy_sees_them() -> None:
    sched, policy = make_scheduler(num_blocks=6)
    first, second = receiving(0, 14), receiving(1, 10)  # 4 blocks, then 3: not both
    sched.add(first)
    sched.add(second)
    out = sched.schedule(0.0)
    assert out.plan is not None and not out.plan.rows
    assert [p.transfer_id for p in out.plan.pulls] == ["t0"]
    assert first.status is Status.RECEIVING and second.status is Status.WAITING
    assert sched.blocks.num_used == 4
    assert all(not v.running and not v.waiting for v in policy.views)
    check_invariants(sched)
    sched.update(out, StepResult(out.iteration, pulls_done=[PullDone("t0")]))
    assert first.num_computed_tokens == 13  # all but the prompt's last token
    out = sched.schedule(0.0)
    assert [r.seq_id for r in policy.views[-1].running] == [0]
    assert out.plan is not None and not out.plan.pulls  # the second still does not fit


def test_a_request_that_ends_mid_pull_keeps_its_blocks_until_the_pull_is_done() -> None:
    sched, _ = make_scheduler(num_blocks=8)
    request = receiving(0, 9)
    sched.add(request)
    out = sched.schedule(0.0)
    assert out.plan is not None and out.plan.pulls
    sched.remove(request)  # aborted while the worker writes its blocks
    assert sched.blocks.num_used == 3 and sched.kv_owners == {0}
    check_invariants(sched)
    later = sched.schedule(0.0)  # a rowless step, to hear how the pull ends
    assert later.plan is not None and not later.plan.rows
    assert sched.update(later, StepResult(later.iteration, pulls_done=[PullDone("t0")])) == []
    assert sched.blocks.num_used == 0 and not sched.has_work()
    check_invariants(sched)


def test_an_overdue_pull_is_named_and_its_blocks_wait_for_the_worker() -> None:
    sched, _ = make_scheduler(num_blocks=8)
    request = receiving(0, 9)
    sched.add(request)
    out = sched.schedule(5.0)
    assert sched.overdue_pulls(7.0, timeout=3.0) == []
    assert sched.overdue_pulls(8.0, timeout=3.0) == [request]
    sched.remove(request)  # the engine ends it kv_transfer_failed
    assert sched.overdue_pulls(9.0, timeout=3.0) == [] and sched.blocks.num_used == 3
    sched.update(out, StepResult(out.iteration, pulls_done=[PullDone("t0", error="late")]))
    assert sched.blocks.num_used == 0 and not sched.has_work()
