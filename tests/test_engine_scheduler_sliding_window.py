"""The scheduler on a model whose every layer attends within a window: the blocks before a
sequence's window are released as it moves on, so a long sequence holds about window /
block_size blocks; its table keeps their places; another sequence may take them."""

from __future__ import annotations

from policies.base import Decision
from service.engine.block_manager import BlockManager
from service.engine.invariants import check_invariants
from service.engine.request import Status
from service.engine.scheduler import Scheduler
from service.engine.step import ScheduleOutput
from tests.scheduler_helpers import make_request, make_scheduler, sampled_result

WINDOW = 8
BLOCK = 4


def step(sched: Scheduler, schedule: list[tuple[int, int]]) -> ScheduleOutput:
    sched.policy.next = Decision(schedule=schedule)  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    for outcome in sched.update(out, sampled_result(out)):
        if outcome.finish is not None:
            outcome.request.status = Status.FINISHED
    check_invariants(sched)
    return out


def windowed(num_blocks: int, *, prefix_caching: bool = False) -> Scheduler:
    sched, _ = make_scheduler(num_blocks=num_blocks, block_size=BLOCK, max_tokens=64)
    blocks = BlockManager(
        num_blocks,
        BLOCK,
        enable_caching=prefix_caching,
        windows=(WINDOW,),
        max_chunk_tokens=sched.max_batched_tokens,
    )
    sched.replace_blocks(blocks)
    return sched


def test_a_long_sequence_holds_its_window_and_its_table_keeps_every_position():
    sched = windowed(16)
    request = make_request(0, 20, max_tokens=40)
    sched.add(request)
    for chunk in (8, 8, 4):  # the prompt in chunks, then decoding
        step(sched, [(0, chunk)])
    most = -(-WINDOW // BLOCK) + 1  # the window's blocks, and the one its start cuts
    for _ in range(30):
        plan = step(sched, [(0, 1)]).plan
        assert plan is not None and len(sched.blocks.table(0)) * BLOCK > plan.start_pos[0]
        assert sched.blocks.num_held(0) <= most
    # without the window it would hold 13 blocks by now
    assert sched.blocks.blocks_to_hold(request.num_tokens) == 13
    assert sched.blocks.num_free == 16 - sched.blocks.num_held(0)


def test_blocks_behind_the_window_go_to_another_sequence():
    sched = windowed(6)  # 24 positions: without the window the first alone fills them
    first = make_request(0, 16, max_tokens=24)
    sched.add(first)
    step(sched, [(0, 16)])
    for _ in range(8):
        step(sched, [(0, 1)])
    behind = sched.blocks.table(0)[: len(sched.blocks.table(0)) - sched.blocks.num_held(0)]
    assert len(behind) == 4 and sched.blocks.num_held(0) == 2
    second = make_request(1, 6, max_tokens=4)
    sched.add(second)
    step(sched, [(0, 1), (1, 6)])
    assert second.status is Status.RUNNING
    reused = set(behind) & set(sched.blocks.held(1))
    assert reused  # the second holds blocks the first's table still names, behind its window
    assert not reused & set(sched.blocks.held(0))


def test_a_cached_block_behind_the_window_stays_findable_until_evicted():
    sched = windowed(16, prefix_caching=True)
    sched.add(make_request(0, 24, max_tokens=4, family=5))
    step(sched, [(0, 24)])
    assert sched.blocks.num_held(0) <= 3 and sched.blocks.num_evictable >= 3
    later = make_request(1, 24, max_tokens=1, family=5)
    sched.add(later)
    step(sched, [(1, 24)])
    assert later.num_cached_tokens == 20  # every full block but the last token's
