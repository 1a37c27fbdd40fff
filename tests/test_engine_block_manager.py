"""Paged KV accounting: growth at block boundaries, free on every path, the invariants."""

from __future__ import annotations

import pytest

from service.engine.block_manager import BlockAccountingError, BlockManager, OutOfBlocks


def test_growth_by_one_block_at_each_boundary():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 3)
    assert bm.num_held(1) == 1
    bm.allocate(1, 4)
    assert bm.num_held(1) == 1  # exactly full, no new block yet
    bm.allocate(1, 5)
    assert bm.num_held(1) == 2
    bm.allocate(1, 2)  # shrinking requests never free
    assert bm.num_held(1) == 2 and bm.num_free == 6
    bm.check_invariants()


def test_free_returns_every_block_and_is_idempotent():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 10)
    bm.allocate(2, 7)
    kept = list(bm.table(2))
    assert bm.free(1) == 3
    assert bm.free(1) == 0
    assert bm.num_free == 6 and bm.table(1) == []
    bm.check_invariants()
    assert bm.table(2) == kept  # the other sequence keeps exactly its blocks
    bm.allocate(3, 4 * 6)  # every block the first one held is reusable, with the rest
    assert sorted(bm.table(3)) == sorted(set(range(8)) - set(kept))


def test_allocation_beyond_free_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 12)
    with pytest.raises(OutOfBlocks):
        bm.allocate(2, 8)
    assert bm.num_held(2) == 0 and bm.num_free == 1
    bm.check_invariants()


def test_watermark_applies_to_admission_only():
    bm = BlockManager(num_blocks=100, block_size=16, watermark=0.1)
    assert bm.watermark_blocks == 10
    bm.allocate(1, 16 * 85)
    assert bm.admission_shortfall(16 * 6) == 1  # would leave 9 < 10 free
    assert bm.admission_shortfall(16 * 5) == 0
    assert bm.can_grow(1, 16 * 95)  # a running sequence may use the reserve


def test_invariant_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    bm._tables[2], bm._dropped[2] = [list(bm._tables[1][0])], [0]  # double ownership
    with pytest.raises(BlockAccountingError):
        bm.check_invariants()
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 4)
    bm._free.append(bm.table(1)[0])  # free and owned at once
    with pytest.raises(BlockAccountingError):
        bm.check_invariants()


def test_a_promise_holds_back_admission_until_its_blocks_are_allocated_or_freed():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate(1, 4)
    bm.promise(1, 24)  # 6 blocks in all: 5 still owed
    assert (bm.num_free, bm.num_promised, bm.num_available) == (9, 5, 4)
    assert bm.admission_shortfall(24) == 2 and bm.admission_shortfall(16) == 0
    assert bm.can_grow(2, 36)  # growth may take promised blocks
    bm.allocate(1, 12)  # a chunk keeps part of the promise: admission sees no change
    assert (bm.num_free, bm.num_promised, bm.num_available) == (7, 3, 4)
    assert bm.num_claimed(1) == 6
    bm.allocate(1, 28)  # past the promise: it is met and gone
    assert bm.num_promised == 0 and bm.num_promised_to(1) == 0
    bm.check_invariants()
    bm.promise(2, 8)
    assert bm.free(2) == 0 and bm.num_promised == 0  # freeing drops a promise too
    bm.check_invariants()
