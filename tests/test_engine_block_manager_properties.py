"""Paged KV accounting under random allocate/free sequences, checked against a plain model.

tests/test_engine_block_manager.py walks through the rules once each. Here hypothesis drives the
BlockManager with arbitrary interleavings of growth, over-asks and frees over several
sequences, and promises of blocks to come, and compares it after every operation with the
obvious model (a sequence of n tokens holds ceil(n / block_size) blocks in each KV group,
a windowed group none wholly behind the window; free = total - held; a promise of n
tokens is owed ceil(n / block_size) - the entries there in each group, a windowed group's
no more than its cap leaves room for, until it is met or the sequence is freed; admission
sees free - owed). The examples below pin the
admission watermark at its boundaries and what `check_invariants` reports for each kind
of corruption it exists to catch.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.engine.block_manager import BlockAccountingError, BlockManager, OutOfBlocks


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 4), st.integers(0, 80)),
        st.tuples(st.just("free"), st.integers(0, 4), st.just(0)),
        st.tuples(st.just("promise"), st.integers(0, 4), st.integers(0, 80)),
        # a sliding window moved on: the next query is at this position
        st.tuples(st.just("drop"), st.integers(0, 4), st.integers(-8, 90)),
    ),
    max_size=40,
)
# One group as most models have, windowed or not, and hybrid ones (a full group beside
# windowed ones, as Gemma's): "w" stands for the drawn window.
GROUPS = [("full",), ("w",), ("full", "w"), ("full", "w", "w")]


# Long on purpose (PLR0915): one trace, each operation beside its model
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(1, 30),
    block_size=st.integers(1, 8),
    watermark=st.floats(0, 0.5),
    groups=st.sampled_from(GROUPS),
    window=st.integers(1, 24),
    max_chunk=st.integers(1, 16),
    ops=operations,
)
def test_random_allocations_and_frees_match_the_model(  # noqa: PLR0915
    num_blocks: int,
    block_size: int,
    watermark: float,
    groups: tuple[str, ...],
    window: int,
    max_chunk: int,
    ops: list[tuple[str, int, int]],
):
    windows = [None if kind == "full" else window for kind in groups]
    bm = BlockManager(
        num_blocks, block_size, watermark, windows=windows, max_chunk_tokens=max_chunk
    )
    assert bm.watermark_blocks == int(watermark * num_blocks)
    cap = -(-(window - 1 + max_chunk) // block_size) + 1  # a windowed group's most
    full, windowed = groups.count("full"), groups.count("w")
    length: dict[int, int] = {}  # seq_id -> table entries (in every group), the model
    dropped: dict[int, int] = {}  # seq_id -> leading entries a windowed group released
    promised: dict[int, int] = {}  # seq_id -> table length promised

    def held(s: int) -> int:
        return full * length.get(s, 0) + windowed * (length.get(s, 0) - dropped.get(s, 0))

    def owed(s: int) -> int:
        to_come = promised.get(s, 0) - length.get(s, 0)
        if to_come <= 0:
            return 0
        in_window = length.get(s, 0) - dropped.get(s, 0)
        return full * to_come + windowed * max(0, min(to_come, cap - in_window))

    def to_hold(tokens: int) -> int:
        entries = blocks_for(tokens, block_size)
        return full * entries + windowed * min(entries, cap)

    for op, seq_id, tokens in ops:
        free_before = bm.num_free
        available = free_before - sum(owed(s) for s in promised)
        if op == "allocate":
            needed = len(groups) * max(0, blocks_for(tokens, block_size) - length.get(seq_id, 0))
            assert bm.extra_blocks(seq_id, tokens) == needed
            assert bm.can_grow(seq_id, tokens) == (needed <= free_before)  # promises or not
            shortfall = to_hold(tokens) - (available - bm.watermark_blocks)
            assert bm.admission_shortfall(tokens) == shortfall
            old_tables = [list(bm.table(seq_id, g)) for g in range(len(groups))]
            if needed > free_before:
                with pytest.raises(OutOfBlocks):
                    bm.allocate(seq_id, tokens)
                assert [bm.table(seq_id, g) for g in range(len(groups))] == old_tables
                assert bm.num_free == free_before
            else:
                bm.allocate(seq_id, tokens)
                if needed:
                    length[seq_id] = blocks_for(tokens, block_size)
                    dropped.setdefault(seq_id, 0)
                for g, old in enumerate(old_tables):  # growth only appends
                    assert bm.table(seq_id, g)[: len(old)] == old
                assert bm.num_free == free_before - needed
            if promised.get(seq_id, 0) <= length.get(seq_id, 0):
                promised.pop(seq_id, None)  # met
        elif op == "promise":
            bm.promise(seq_id, tokens)
            if blocks_for(tokens, block_size) > length.get(seq_id, 0):
                promised[seq_id] = blocks_for(tokens, block_size)
            else:
                promised.pop(seq_id, None)
        elif op == "drop":
            tables = [list(bm.table(seq_id, g)) for g in range(len(groups))]
            first = dropped.get(seq_id, 0)
            until = min(max(tokens - window + 1, 0) // block_size, length.get(seq_id, 0))
            released = windowed * max(0, until - first)
            assert bm.drop_behind_window(seq_id, tokens) == released
            assert [bm.table(seq_id, g) for g in range(len(groups))] == tables  # positions index
            if released:
                dropped[seq_id] = until
            assert bm.num_free == free_before + released
        else:
            freed = bm.free(seq_id)
            promised.pop(seq_id, None)
            assert freed == held(seq_id)
            length.pop(seq_id, None)
            dropped.pop(seq_id, None)
            assert bm.table(seq_id) == [] and bm.num_held(seq_id) == 0
            assert bm.num_free == free_before + freed
        for s in range(5):
            assert bm.num_held(s) == held(s) == len(bm.held(s))
            assert all(len(bm.table(s, g)) == length.get(s, 0) for g in range(len(groups)))
            assert bm.num_promised_to(s) == owed(s)
            assert bm.num_claimed(s) == held(s) + owed(s)
        assert bm.num_promised == sum(owed(s) for s in promised)
        assert bm.num_available == bm.num_free - bm.num_promised
        assert bm.num_used == sum(map(held, range(5))) == num_blocks - bm.num_free
        owned = [b for s in range(5) for b in bm.held(s)]
        assert len(owned) == len(set(owned))
        assert all(0 <= b < num_blocks for b in owned)
        bm.check_invariants()
    for s in range(5):
        bm.free(s)
    assert bm.num_free == num_blocks and bm.num_used == 0 and bm.num_promised == 0
    bm.check_invariants()


@pytest.mark.parametrize(("num_blocks", "block_size"), [(-1, 16), (8, 0), (8, -4)])
def test_a_manager_needs_blocks_of_at_least_one_token(num_blocks: int, block_size: int):
    message = r"^num_blocks must be at least 0 and block_size positive$"
    with pytest.raises(ValueError, match=message):
        BlockManager(num_blocks, block_size)


def test_a_manager_without_blocks_admits_nothing():
    """A scheduler's before its first worker answers."""
    bm = BlockManager(0, 16, watermark=0.01)
    assert bm.num_free == bm.num_used == 0 and bm.admission_shortfall(1) > 0
    bm.check_invariants()


def test_without_a_watermark_admission_may_use_every_free_block():
    bm = BlockManager(4, 4)
    assert bm.watermark_blocks == 0
    assert bm.admission_shortfall(16) == 0 and bm.admission_shortfall(17) == 1


def test_the_smallest_manager_works():
    bm = BlockManager(1, 1)
    assert bm.num_free == 1 and bm.num_used == 0 and bm.block_size == 1
    bm.allocate(7, 1)
    assert bm.table(7) == [0] and bm.num_free == 0
    assert not bm.can_grow(7, 2) and bm.can_grow(7, 1)
    bm.check_invariants()


def test_a_fresh_manager_has_every_block_free_and_distinct():
    bm = BlockManager(6, 4)
    bm.allocate(1, 24)
    assert sorted(bm.table(1)) == list(range(6))
    assert bm.num_free == 0 and bm.num_used == 6


def test_blocks_to_hold_rounds_up_to_whole_blocks():
    bm = BlockManager(8, 4)
    assert [bm.blocks_to_hold(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_a_windowed_group_holds_at_most_its_cap_and_the_longest_fitting_sequence_follows():
    """Block size 4, window 8, chunks of 4 tokens: a windowed group holds at most the window's
    2 blocks, the chunk's one and the one the window's start cuts (cap 4)."""
    hybrid = BlockManager(100, 4, windows=(None, 8, 8), max_chunk_tokens=4)
    assert hybrid.caps == (None, 4, 4)
    assert [hybrid.blocks_to_hold(n) for n in (4, 12, 16, 40)] == [3, 9, 12, 18]
    assert hybrid.tokens_fitting(18) == 40 and hybrid.tokens_fitting(17) == 36
    assert hybrid.tokens_fitting(2) == 0  # a first entry takes a block in each of 3 groups
    windowed = BlockManager(100, 4, windows=(8,), max_chunk_tokens=4)
    assert windowed.tokens_fitting(4) == sys.maxsize  # any length fits in its cap
    assert windowed.tokens_fitting(3) == 12
    assert BlockManager(100, 4).tokens_fitting(7) == 28


def test_a_freed_block_is_handed_out_again():
    bm = BlockManager(4, 4)
    bm.allocate(1, 16)
    first = list(bm.table(1))
    bm.free(1)
    bm.allocate(2, 16)
    assert sorted(bm.table(2)) == sorted(first)
    bm.check_invariants()


def test_asking_for_fewer_tokens_than_held_is_a_no_op():
    bm = BlockManager(4, 4)
    bm.allocate(1, 9)
    table = list(bm.table(1))
    bm.allocate(1, 0)
    bm.allocate(1, 8)
    assert bm.table(1) == table and bm.num_free == 1
    assert bm.extra_blocks(1, 1) == 0


def test_the_out_of_blocks_error_names_the_sequence_and_the_shortfall():
    bm = BlockManager(3, 4)
    bm.allocate(1, 8)
    with pytest.raises(OutOfBlocks, match=r"sequence 2 needs 2 blocks, 1 free"):
        bm.allocate(2, 5)


@pytest.mark.parametrize(
    ("used", "asked", "admitted"),
    [
        (0, 8, True),  # 10 free, 2 reserved: 8 may be admitted
        (0, 9, False),
        (6, 2, True),  # 4 free: exactly 2 above the reserve
        (6, 3, False),
        (8, 0, True),  # nothing asked
        (8, 1, False),  # only the reserve is left
    ],
)
def test_admission_keeps_the_watermark_free(used: int, asked: int, admitted: bool):
    bm = BlockManager(10, 1, watermark=0.2)
    if used:
        bm.allocate(99, used)
    assert (bm.admission_shortfall(asked) <= 0) is admitted
    # a running sequence may grow into the reserve
    assert bm.can_grow(99, used + bm.num_free)
    assert not bm.can_grow(99, used + bm.num_free + 1)


def test_the_watermark_rounds_down_to_whole_blocks():
    assert BlockManager(10, 4, watermark=0.19).watermark_blocks == 1
    assert BlockManager(10, 4, watermark=0.0).watermark_blocks == 0
    assert BlockManager(3, 4, watermark=0.5).watermark_blocks == 1


# ---- check_invariants: each kind of corruption is reported ------------------------------


def corrupted(kind: str) -> BlockManager:
    bm = BlockManager(4, 4)
    bm.allocate(1, 4)
    bm.allocate(2, 4)
    owned = bm.table(1)[0]
    if kind == "empty table":
        bm._tables[3], bm._dropped[3] = [[]], [0]
    elif kind == "unequal tables":
        bm._tables[1].append([])
    elif kind == "out of range":
        bm._tables[1][0].append(4)
    elif kind == "negative block":
        bm._tables[1][0].append(-1)
    elif kind == "free twice":
        bm._free.append(bm._free[0])
    elif kind == "refcount too high":
        bm._refcount[owned] += 1
    elif kind == "refcount of a free block":
        bm._refcount[bm._free[0]] = 1
    elif kind == "held twice by one":
        bm._tables[1][0].append(owned)
        bm._refcount[owned] += 1
    elif kind == "evictable and free":
        block = bm._free[0]
        bm._hash_of[block], bm._block_of[0][b"h"] = (0, b"h"), block
        bm._evictable[block] = None
    elif kind == "evictable without hash":
        bm._evictable[bm._free.pop()] = None
    elif kind == "hash maps disagree":
        bm._hash_of[owned] = (0, b"x")
    elif kind == "free and owned":
        bm._free.append(owned)
    elif kind == "lost block":
        bm._free.pop()
    elif kind == "stray free block":
        bm._free.append(4)
    elif kind == "met promise kept":
        bm._promised[1] = 1
    elif kind == "promised count drifted":
        bm._num_promised += 1
    return bm


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("empty table", "empty table"),
        ("unequal tables", r"^sequence 1's tables differ from its groups$"),
        ("out of range", "out of range"),
        ("negative block", "out of range"),
        ("free twice", r"^a block is on the free list twice$"),
        ("refcount too high", "refcount 2 but 1 owners"),
        ("refcount of a free block", "refcount 1 but 0 owners"),
        ("held twice by one", r"^sequence 1 holds a block twice$"),
        ("evictable and free", r"^block \d is in 2 of free, evictable and held$"),
        ("evictable without hash", r"^evictable block \d has no hash$"),
        ("hash maps disagree", r"^the hash -> block and block -> hash maps disagree$"),
        ("free and owned", r"is in 2 of free, evictable and held$"),
        ("lost block", r"is in 0 of free, evictable and held$"),
        ("stray free block", r"^free 3 \+ evictable 0 \+ held 2 != total 4$"),
        ("met promise kept", r"^sequence 1: a met promise is still counted$"),
        ("promised count drifted", r"^promised 1 but 0 blocks owed$"),
    ],
)
def test_check_invariants_reports_each_kind_of_corruption(kind: str, message: str):
    bm = corrupted(kind)
    with pytest.raises(BlockAccountingError, match=message):
        bm.check_invariants()


def test_check_invariants_accepts_every_consistent_state():
    bm = BlockManager(4, 4)
    bm.check_invariants()
    bm.allocate(1, 4)
    bm.allocate(2, 12)
    bm.check_invariants()
    bm.free(1)
    bm.check_invariants()
