"""The scheduler's side of a handover, step by step: a consumer's receiving request waits
for blocks in arrival order, is never offered to the policy while its K/V is on the move,
and one that ends mid-pull keeps its blocks until the worker reports the pull done (the pull
still writes them). A producer's step that ends a do_remote_decode request stages its prompt
in a region of the arena, which the hold keeps until it ends, and an abort frees. A
consumer's reading notice keeps its hold while the read may run. With KV groups (a full one
and a windowed one here, as Gemma's), a producer's hold and a consumer's pull name each
group's blocks, a windowed group's only those its window reads from the handover's position
on."""

from __future__ import annotations

import dataclasses

from gpu_worker.protocol import KvStage, PullDone, StepResult
from policies.base import Decision
from service.engine.block_manager import BlockManager
from service.engine.invariants import check_invariants
from service.engine.kv_transfer import KvHolds, RemoteKv, StagingArena
from service.engine.request import Request, Status
from service.engine.scheduler import Scheduler
from service.engine.step import ScheduleOutput
from tests.scheduler_helpers import make_request, make_scheduler, sampled_result

WINDOW = 6  # the windowed group's (block size 4)


def receiving(seq_id: int, prompt_len: int, block_ids: list[list[int]] | None = None) -> Request:
    request = make_request(seq_id, prompt_len)
    ids = block_ids or [[0] * -(-prompt_len // 4)]
    remote = RemoteKv(f"t{seq_id}", "e", "local", 1, ids, [], 9, prompt_len)
    request.params = dataclasses.replace(request.params, remote_kv=remote)
    return request


def hybrid(num_blocks: int) -> Scheduler:
    """A scheduler over a full KV group and a windowed one, with the prefix cache."""
    sched, _ = make_scheduler(num_blocks=num_blocks, max_tokens=8, prefix_caching=True)
    windows = (None, WINDOW)
    sched.replace_blocks(BlockManager(num_blocks, 4, windows=windows, max_chunk_tokens=8))
    return sched


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


def producing(seq_id: int, prompt_len: int) -> Request:
    request = make_request(seq_id, prompt_len, max_tokens=1)
    request.params = dataclasses.replace(request.params, remote_decode=True)
    return request


def producer(arena_blocks: int) -> Scheduler:
    sched, _ = make_scheduler(num_blocks=16)
    sched.kv_holds, sched.kv_staging = KvHolds(timeout=50.0), StagingArena(arena_blocks)
    return sched


def ended_prompt(sched: Scheduler, request: Request, chunks: list[int]) -> ScheduleOutput:
    """Schedules `request`'s prompt in `chunks`, each step's result applied but the last's:
    the last step's output (it samples the request's one token)."""
    sched.add(request)
    for i, tokens in enumerate(chunks):
        sched.policy.next = Decision(schedule=[(request.seq_id, tokens)])  # type: ignore[attr-defined]
        out = sched.schedule(float(i))
        assert out.plan is not None
        if i < len(chunks) - 1:
            assert not out.plan.stages  # only the step that ends it stages
            sched.update(out, sampled_result(out))
    return out


def test_the_step_that_ends_a_held_prompt_stages_it_until_the_hold_ends() -> None:
    sched = producer(arena_blocks=5)
    out = ended_prompt(sched, producing(0, 10), [4, 6])
    assert out.plan is not None
    assert out.plan.stages == [KvStage(sched.blocks.table(0)[:3], 0)]
    sched.update(out, sampled_result(out))
    assert sched.kv_holds is not None and sched.kv_staging is not None
    (hold,) = sched.kv_holds.by_id.values()
    assert hold.staged_at == 0 and sched.kv_staging.used == 3
    check_invariants(sched)
    # a second prompt finds no room left (2 blocks free, 3 wanted): held unstaged
    out = ended_prompt(sched, producing(1, 12), [12])
    assert out.plan is not None and not out.plan.stages
    sched.update(out, sampled_result(out))
    assert sched.kv_staging.state() == {"blocks": 5, "used": 3, "staged": 1, "unstaged": 1}
    assert [h.staged_at for h in sched.kv_holds.by_id.values()] == [0, None]
    released = sched.schedule(10.0)  # the consumer's notice frees the region with the hold
    sched.update(released, StepResult(released.iteration, notices=[hold.transfer_id]))
    assert sched.kv_staging.used == 0
    check_invariants(sched)
    out = ended_prompt(sched, producing(2, 9), [9])  # the region is taken again
    assert out.plan is not None and out.plan.stages == [KvStage(sched.blocks.table(2)[:3], 0)]
    sched.update(out, sampled_result(out))
    sched.schedule(1000.0)  # every hold expired: blocks and regions back
    assert sched.kv_staging.used == 0 and sched.blocks.num_used == 0
    check_invariants(sched)


def test_a_staged_request_that_ends_otherwise_frees_its_region() -> None:
    sched = producer(arena_blocks=8)
    request = producing(0, 7)
    out = ended_prompt(sched, request, [7])
    assert out.plan is not None and out.plan.stages
    sched.remove(request)  # aborted while the worker runs the step (as the engine ends it)
    request.status = Status.FINISHED
    assert sched.kv_staging is not None and sched.kv_staging.used == 0
    check_invariants(sched)
    assert sched.update(out, sampled_result(out)) == []  # its token comes too late
    assert sched.kv_holds is not None and not sched.kv_holds.by_id
    failed = ended_prompt(sched, producing(1, 7), [7])  # a worker error fails it
    sched.update(failed, StepResult(failed.iteration, error="boom"))
    assert sched.kv_staging.used == 0 and sched.blocks.num_used == 0
    check_invariants(sched)


def test_an_expired_holds_id_goes_to_the_worker_once() -> None:
    """Its ranks' notices counted so far are dropped (gpu_worker.kv_ranks), by the next plan."""
    sched = producer(arena_blocks=0)
    out = ended_prompt(sched, producing(0, 6), [6])
    sched.update(out, sampled_result(out))
    assert sched.kv_holds is not None
    (hold,) = sched.kv_holds.by_id.values()
    sched.add(make_request(1, 4))
    sched.policy.next = Decision(schedule=[(1, 4)])  # type: ignore[attr-defined]
    after = sched.schedule(100.0)  # past the hold's 50 s: expired
    assert after.plan is not None and after.plan.forgotten == [hold.transfer_id]
    sched.update(after, sampled_result(after))
    sched.policy.next = Decision(schedule=[(1, 1)])  # type: ignore[attr-defined]
    again = sched.schedule(101.0)
    assert again.plan is not None and again.plan.forgotten == []


def test_a_reading_notice_keeps_the_hold_while_the_read_may_run() -> None:
    sched = producer(arena_blocks=0)
    assert sched.kv_holds is not None
    sched.kv_holds.read_timeout = 200.0
    out = ended_prompt(sched, producing(0, 6), [6])
    sched.update(out, sampled_result(out))
    (hold,) = sched.kv_holds.by_id.values()
    assert hold.deadline == 50.0  # made at 0.0, the hold timeout 50
    reading = sched.schedule(40.0)
    sched.update(reading, StepResult(reading.iteration, reading=[hold.transfer_id, "gone"]))
    assert hold.deadline == 240.0 and sched.kv_holds.kept == 1
    later = sched.schedule(100.0)  # past its first deadline: still held
    assert sched.kv_holds.by_id and sched.blocks.num_used == 2
    sched.update(later, StepResult(later.iteration, notices=[hold.transfer_id]))
    assert sched.kv_holds.released == 1 and sched.blocks.num_used == 0


def test_a_producer_holds_each_groups_blocks_a_windowed_one_from_the_handovers_window() -> None:
    """21 tokens in chunks of 8: the windowed group would drop entries 0-3 once the prompt
    is computed (a query at 21 reads from 16 on); it keeps those a query at 20, the
    handover's position (a later hit's first computed one), reads: entries 3-5."""
    sched = hybrid(24)
    sched.kv_holds = KvHolds(timeout=10.0)
    request = make_request(0, 21, max_tokens=1)
    request.params = dataclasses.replace(request.params, remote_decode=True)
    sched.add(request)
    while request.kv_hold is None:
        out = sched.schedule(0.0)
        sched.update(out, sampled_result(out))
        check_invariants(sched)
    tables = [sched.blocks.table(0, g) for g in (0, 1)]
    assert request.kv_hold.block_ids == [tables[0][:6], tables[1][3:6]]
    assert sched.blocks.num_used == 9  # the hold's, nothing more
    sched.update(out, StepResult(out.iteration, notices=[request.kv_hold.transfer_id]))
    # every full block of each group was registered as it was computed: all cached
    assert sched.blocks.num_used == 0 and sched.blocks.num_cached == 5 + 5
    check_invariants(sched)


def test_a_consumer_pulls_each_groups_blocks_into_what_its_windows_read() -> None:
    sched = hybrid(24)
    remote = [[100, 101, 102, 103, 104, 105], [203, 204, 205]]
    request = receiving(0, 21, remote)
    sched.add(request)
    out = sched.schedule(0.0)
    assert out.plan is not None and len(out.plan.pulls) == 1
    pull = out.plan.pulls[0]
    full, windowed = sched.blocks.table(0, 0), sched.blocks.table(0, 1)
    assert pull.remote_blocks == [*remote[0], *remote[1]]
    assert pull.local_blocks == [*full, *windowed[3:]]  # no block for entries 0-2
    assert sched.blocks.num_used == 9
    check_invariants(sched)
    sched.update(out, StepResult(out.iteration, pulls_done=[PullDone("t0")]))
    # the pulled full blocks are cached: the full group's 5, the windowed group's 3 and 4
    assert request.num_computed_tokens == 20 and sched.blocks.num_cached == 5 + 2
    sched.policy.next = Decision(schedule=[(0, 1)])  # type: ignore[attr-defined]
    out = sched.schedule(0.0)
    assert out.plan is not None and out.plan.start_pos == [20]
    sched.update(out, sampled_result(out))
    check_invariants(sched)
