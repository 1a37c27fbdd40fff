"""The engine's state checked whole: what --debug-invariants asserts every iteration, and
what the scheduler's tests assert after every step.

Each owner checks its own records (BlockManager.check_invariants, TenantSlots'); these
checks hold them together: every block and promise belongs to a sequence the scheduler
knows, no sequence writes a block another reads, no request is preempted beyond the cap,
and no block a plan in flight writes goes to another sequence before its result is in.
"""

from __future__ import annotations

from service.engine.scheduler import Scheduler
from service.engine.step import ScheduleOutput


def check_invariants(sched: Scheduler) -> None:
    """Block accounting is exact, every block and promise belongs to a sequence it knows,
    and no request is preempted beyond the cap."""
    sched.blocks.check_invariants()
    _check_blocks_held(sched)
    _check_promises(sched)
    _check_written(sched)
    if sched.kv_staging is not None:
        sched.kv_staging.check_invariants({r.seq_id for r in sched.sequences} | sched.kv_owners)
    blocks = sched.blocks
    running_promises = sum(blocks.num_promised_to(r.seq_id) for r in sched.running)
    assert blocks.num_promised == running_promises, "a promise outlived its sequence"
    assert sched.running or not sched.rules.admission_paused, (
        "paused with nothing left to resume it"
    )
    assert all(r.preemptions <= sched.rules.max_preemptions for r in sched.sequences)
    sched.tenants.check_invariants(sched.running, sched.waiting)


def _check_blocks_held(sched: Scheduler) -> None:
    """Every used block is held by a sequence the scheduler knows, and none it computed is lost."""
    blocks = sched.blocks
    held = {r.seq_id for r in sched.sequences if blocks.num_held(r.seq_id)}
    if None in blocks.windows:  # all-windowed tables may drop every block held
        computed = {r.seq_id for r in sched.running if r.num_computed_tokens}
        assert held >= computed, "lost blocks"
    owners = {r.seq_id for r in sched.sequences} | sched.kv_owners
    tables = [blocks.held(seq_id) for seq_id in owners]
    assert blocks.num_used == len({b for table in tables for b in table}), "stray block"


def _check_promises(sched: Scheduler) -> None:
    """A prefill is owed the rest of its prompt (a windowed group's up to its cap); after
    it samples, nothing."""
    windowed = any(sched.blocks.windows)
    for r in sched.running:
        owed = sched.blocks.num_promised_to(r.seq_id)
        rest = sched.blocks.extra_blocks(r.seq_id, r.num_tokens)
        assert owed == rest or (owed == 0 and r.remaining == 1) or (windowed and owed < rest), (
            f"sequence {r.seq_id}: promised {owed} blocks"
        )


def _check_written(sched: Scheduler) -> None:
    """The blocks a running sequence writes next are its alone and not cached, and it has
    something to compute or has sampled."""
    blocks = sched.blocks
    for r in sched.running:
        first = r.num_computed_tokens // blocks.block_size
        written = [
            block for g in range(blocks.num_groups) for block in blocks.table(r.seq_id, g)[first:]
        ]
        assert all(blocks.refcount(b) == 1 for b in written), "a shared block is written"
        assert not any(map(blocks.is_cached, written)), "a cached block is written"
        assert r.num_computed_tokens < r.num_tokens or r.num_generated, "nothing to sample"


def check_blocks_kept(sched: Scheduler, out: ScheduleOutput) -> None:
    """No block the step just computed wrote went to another sequence while the worker ran
    it: blocks freed meanwhile (stop string, abort) wait for the next schedule(). (The
    blocks it only read may be shared: cached prefixes are.)"""
    holders: dict[int, set[int]] = {}
    for request in (*sched.running, *sched.waiting):
        for block in sched.blocks.held(request.seq_id):
            holders.setdefault(block, set()).add(request.seq_id)
    for item, written in zip(out.scheduled, out.written, strict=True):
        seq_id = item.request.seq_id
        taken = [block for block in written if holders.get(block, {seq_id}) != {seq_id}]
        assert not taken, f"step {out.iteration}: blocks {taken} of seq {seq_id} reallocated"
