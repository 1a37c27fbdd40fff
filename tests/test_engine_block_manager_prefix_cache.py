"""The prefix cache of the block manager: hash-chained full blocks, sharing by reference
count, LRU eviction, reset; and a hypothesis model of all of it."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.engine.block_manager import BlockManager, chain_hashes

SIZE = 4


def computed(bm: BlockManager, seq_id: int, tokens: list[int]) -> list[bytes]:
    """`seq_id` allocates and computes `tokens` from scratch (after its hit, if shared)."""
    bm.allocate(seq_id, len(tokens))
    hashes = chain_hashes(tokens, SIZE, [])
    bm.register(seq_id, hashes, len(tokens))
    return hashes


def test_a_hash_names_the_whole_prefix_not_only_its_block():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], SIZE, [])
    b = chain_hashes([9, 9, 9, 9, 5, 6, 7, 8], SIZE, [])
    assert len(a) == len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second block, other parent
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], SIZE, []) == a  # partial blocks: none
    known = a[:1]
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], SIZE, known) is known and known == a


def test_a_salt_separates_the_chains_of_equal_prompts():
    tokens = list(range(8))
    plain, a, b = (chain_hashes(tokens, SIZE, [], salt) for salt in (None, "a", "b"))
    assert len({plain[0], a[0], b[0]}) == 3 and len({plain[1], a[1], b[1]}) == 3
    assert chain_hashes(tokens, SIZE, [], "a") == a


def test_only_full_computed_blocks_are_found():
    bm = BlockManager(8, SIZE)
    tokens = list(range(10))
    bm.allocate(1, 10)
    hashes = chain_hashes(tokens, SIZE, [])
    bm.register(1, hashes, 5)  # one block computed so far
    assert bm.match(hashes).blocks == bm.table(1)[:1]
    bm.register(1, hashes, 10)
    assert bm.match(hashes).blocks == bm.table(1)[:2]  # the third block is partial
    bm.check_invariants()


def test_a_shared_block_is_freed_only_by_its_last_holder():
    bm = BlockManager(8, SIZE)
    hashes = computed(bm, 1, list(range(8)))
    hit = bm.match(hashes)
    bm.share(2, hit)
    bm.allocate(2, 10)
    assert bm.table(2)[:2] == hit.blocks and [bm.refcount(b) for b in hit.blocks] == [2, 2]
    assert bm.num_used == 3  # two shared, one of 2's own
    assert bm.num_claimed(2) == 1  # freeing 2 gives back only the block it holds alone
    bm.free(1)
    assert [bm.refcount(b) for b in hit.blocks] == [1, 1] and bm.num_evictable == 0
    bm.free(2)
    assert bm.num_evictable == 2 and bm.num_free == 8 and bm.num_cached == 2
    bm.check_invariants()


def test_an_evictable_hit_costs_admission_a_block_a_held_one_does_not():
    bm = BlockManager(8, SIZE)
    hashes = computed(bm, 1, list(range(8)))
    hit = bm.match(hashes)
    assert bm.admission_cost(12, hit) == 1  # 3 blocks, 2 of them held by sequence 1
    bm.free(1)
    assert bm.admission_cost(12, hit) == 3  # now taking them takes them from the free
    bm.share(2, hit)
    assert bm.num_free == 6 and bm.num_evictable == 0
    bm.check_invariants()


def test_allocation_takes_plain_free_blocks_before_evicting_and_then_the_lru_one():
    bm = BlockManager(4, SIZE)
    first = computed(bm, 1, [1] * 4)
    second = computed(bm, 2, [2] * 4)
    bm.free(2)
    bm.free(1)  # released last: the most recently used
    bm.allocate(3, 8)  # the two plain free blocks
    assert bm.num_evictable == 2 and bm.num_evicted == 0
    bm.allocate(4, 4)  # none plain free: evicts sequence 2's block, released first
    assert bm.num_evicted == 1 and bm.match(second).blocks == [] and bm.match(first).num_blocks == 1
    bm.check_invariants()


def test_a_chain_is_evicted_from_its_tail():
    """Released last block first, so the head, which more prompts share, stays longest."""
    bm = BlockManager(3, SIZE)
    hashes = computed(bm, 1, list(range(12)))
    bm.free(1)
    bm.allocate(2, 4)
    assert bm.match(hashes).num_blocks == 2  # the third block went first
    bm.allocate(2, 8)
    assert bm.match(hashes).num_blocks == 1
    bm.check_invariants()


def test_a_duplicate_block_stays_unregistered_and_the_first_copy_serves():
    bm = BlockManager(8, SIZE)
    a = computed(bm, 1, [5] * 4)
    computed(bm, 2, [5] * 4)  # computed beside it, before it was found
    assert bm.num_cached == 1 and bm.match(a).blocks == bm.table(1)
    bm.free(2)
    assert bm.num_evictable == 0 and bm.num_free == 7  # the copy went back as plain free
    bm.check_invariants()


def test_reset_forgets_every_hash_and_keeps_what_is_held():
    bm = BlockManager(8, SIZE)
    held = computed(bm, 1, list(range(8)))
    gone = computed(bm, 2, [7] * 8)
    bm.share(3, bm.match(held))
    bm.free(2)
    assert bm.reset_cache() == 4
    assert bm.match(held).blocks == [] and bm.match(gone).blocks == []
    assert bm.num_evictable == 0 and bm.num_free == 6 and bm.table(3) == bm.table(1)
    bm.free(1)
    bm.free(3)
    assert bm.num_free == 8
    bm.check_invariants()


def test_with_caching_off_nothing_is_registered_or_found():
    bm = BlockManager(8, SIZE, enable_caching=False)
    hashes = computed(bm, 1, list(range(8)))
    assert bm.match(hashes).blocks == [] and bm.num_cached == 0
    bm.free(1)
    assert bm.num_evictable == 0 and bm.num_free == 8


# ---- the model --------------------------------------------------------------------------

# shared heads, and more distinct blocks than the smaller caches hold
PROMPTS = [[1] * 12, [1] * 8 + [2] * 4, [3] * 16, [1] * 4 + [4] * 8, [5] * 8 + [6] * 8]


def grow_one_block(
    bm: BlockManager,
    seq_id: int,
    tokens: list[int],
    computed_upto: dict[int, int],
    content: dict[int, tuple[int, ...]],
) -> None:
    done = computed_upto[seq_id]
    if done >= len(tokens) or not bm.can_grow(seq_id, done + SIZE):
        return
    for block in bm.table(seq_id)[done // SIZE :]:
        assert bm.refcount(block) == 1 and not bm.is_cached(block), "writes a shared block"
    bm.allocate(seq_id, done + SIZE)
    content[bm.table(seq_id)[done // SIZE]] = tuple(tokens[: done + SIZE])
    computed_upto[seq_id] = done + SIZE
    bm.register(seq_id, chain_hashes(tokens, SIZE, []), done + SIZE)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(2, 8),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["start"] * 4 + ["grow"] * 5 + ["free"] * 2 + ["reset"]),
            st.integers(0, 7),
        ),
        min_size=20,
        max_size=80,
    ),
)
def test_any_sequence_of_operations_keeps_the_accounting_exact(
    num_blocks: int, ops: list[tuple[str, int]]
):
    """Sequences start from their cached prefix, compute block by block, and are freed in
    any order: free + evictable + held == total after every operation, references match
    the tables, a hit names blocks whose content is the prefix asked for, and no block is
    written while shared or cached."""
    bm = BlockManager(num_blocks, SIZE)
    content: dict[int, tuple[int, ...]] = {}  # block -> the prefix its K/V was computed for
    live: dict[int, list[int]] = {}  # seq_id -> its tokens
    computed_upto: dict[int, int] = {}
    for op, arg in ops:
        seq_id = arg
        if op == "start" and seq_id not in live:
            tokens = PROMPTS[arg % len(PROMPTS)]
            hashes = chain_hashes(tokens, SIZE, [])
            hit = bm.match(hashes[: (len(tokens) - 1) // SIZE])
            for index, block in enumerate(hit.blocks):
                assert content[block] == tuple(tokens[: (index + 1) * SIZE]), "a wrong hit"
            if bm.admission_cost(len(tokens), hit) > bm.num_free:
                continue
            bm.share(seq_id, hit)
            live[seq_id], computed_upto[seq_id] = tokens, hit.num_blocks * SIZE
        elif op == "grow":
            for grower in [seq_id] if seq_id in live else list(live):  # one, or everyone
                grow_one_block(bm, grower, live[grower], computed_upto, content)
        elif op == "free" and seq_id in live:
            del live[seq_id], computed_upto[seq_id]
            bm.free(seq_id)
        elif op == "reset":
            bm.reset_cache()
        bm.check_invariants()
        held = {b for seq in live for b in bm.table(seq)}
        assert len(held) + bm.num_free == num_blocks
    for seq_id in list(live):
        bm.free(seq_id)
    assert bm.num_free == num_blocks and bm.num_used == 0
    bm.check_invariants()


def test_a_pulled_sequence_starts_from_its_hit_and_its_windows_hold_only_what_they_read():
    """allocate_reading, as a consumer allocates for a handed-over prompt of 21 tokens
    whose first query is at 20 (a window of 6 reads entries 3 on): the cached hit of 2
    entries starts every table, the windowed group's hit blocks behind the window go back
    (evictable), and its entry 2 (never read) holds no block."""
    bm = BlockManager(40, SIZE, windows=(None, 6), max_chunk_tokens=8)
    tokens = list(range(21))
    hashes = computed(bm, 0, tokens[:8])
    bm.free(0)
    hit = bm.match(hashes)
    assert hit.num_blocks == 2
    bm.allocate_reading(1, 21, 20, hit)
    full, windowed = bm.table(1, 0), bm.table(1, 1)
    assert full[:2] == list(hit.tables[0]) and len(full) == len(windowed) == 6
    assert bm.num_held(1) == 6 + 3 and bm.num_evictable == 2  # the windowed hit's, back
    assert all(bm.refcount(b) == 1 for b in full[:2])
    assert bm.reading_tables(1, 21, 20, from_entry=2) == [full[2:], windowed[3:]]
    bm.check_invariants()
    bm.free(1)
    assert bm.num_used == 0
    bm.check_invariants()
