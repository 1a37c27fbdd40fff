"""Paged KV accounting: which of the worker's blocks each sequence holds, and the prefix cache.

The tensors live in the worker; here are only block ids 0..num_blocks-1, each with a
reference count: the number of sequences whose tables hold it.

KV groups. A model whose layers all attend alike has one group: a sequence has one table,
and its entry i is the block of positions i x block_size on, in every layer. A hybrid
model (Gemma 2 and 3: windowed layers beside full ones) has several groups of layers, of
the same size (the worker's gpu_worker.kv_groups): a block holds block_size positions of
one group's layers, all groups draw their blocks from the one pool, and a sequence has a
table per group, each as long as the others. That is vLLM's hybrid KV cache manager: a
windowed group gives back what its window no longer reads while the full groups keep all.

Sliding windows. A windowed group's blocks wholly before a sequence's window are never
read again: `drop_behind_window` releases them (to the free list, or evictable when
cached). The table keeps their ids at their places, so positions still index it, but they
are no longer its blocks (`held` is the rest): another sequence may take one, and its keys
there are masked out by the window. A windowed group thus holds at most its `cap`: the
window's blocks, a chunk's, and the one the window's start cuts.

Prefix caching. A block that a sequence has filled and computed is registered under a hash
chained from its parent's (`chain_hashes`): the hash names the block's tokens and every
token before them, so equal hashes mean equal K/V (per group). A newcomer's longest hit is
`match`ed and `share`d: its tables start with those blocks (reference counted, never
written again: a sequence only writes past its computed tokens, which start after them).
A hit covers the leading positions in every full group, and in a windowed group only the
window of the position the newcomer computes first (the entries before it are never read).
A released block that holds a hash is kept, *evictable*, in least-recently-released order
instead of going to the free list; it is taken back by a later match, or evicted (its hash
forgotten) when an allocation finds no plain free block. Both kinds count as free.

A sequence admitted on its whole prompt is allocated its blocks chunk by chunk; the blocks
it will still need (a windowed group's up to its cap) are *promised* to it, and admission
counts only the free blocks nobody is promised (`num_available`), so two long prompts are
never admitted against the same blocks. A promise binds admission only: growth
(`can_grow`) may take any free block.
"""

from __future__ import annotations

import collections
import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class BlockAccountingError(AssertionError):
    """The invariants of the block accounting do not hold (a bug, never user input)."""


class OutOfBlocks(RuntimeError):
    """An allocation asked for more blocks than are free (the scheduler checks first)."""


def chain_hashes(
    token_ids: Sequence[int], block_size: int, known: list[bytes], salt: str | None = None
) -> list[bytes]:
    """Extend `known`, the hashes of the first full blocks of `token_ids`, to every full
    block; returns it. A block's hash covers its parent's, so it names the whole prefix;
    the first block's parent is the `salt`, so only prompts with the same salt share.
    SHA-256, not Python's hash(): a collision would hand one request another's K/V."""
    for index in range(len(known), len(token_ids) // block_size):
        digest = hashlib.sha256(known[-1] if known else _root(salt))
        block = token_ids[index * block_size : (index + 1) * block_size]
        digest.update(array("q", block).tobytes())
        known.append(digest.digest())
    return known


def first_entry_read(window: int | None, block_size: int, position: int) -> int:
    """The first table entry a query at `position` reads in a group of `window` (None:
    full attention, every entry); the entries before it are wholly behind the window."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def _root(salt: str | None) -> bytes:
    """The first block's parent: nothing, or the salt's own hash."""
    return b"" if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode()).digest()


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached blocks a newcomer starts with (BlockManager.match): those of its first
    `num_blocks` table entries, per group; a windowed group's from entry `first_kept[g]`
    on (its window's), a full group's all."""

    tables: tuple[tuple[int, ...], ...]
    first_kept: tuple[int, ...]
    num_blocks: int

    @property
    def blocks(self) -> list[int]:
        """Every block the hit names, in all groups."""
        return [block for table in self.tables for block in table]


# What a windowed table holds at entries it never reads (a hit skips them): any block id.
_UNREAD = 0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.0,
        enable_caching: bool = True,
        *,
        windows: Sequence[int | None] = (None,),
        max_chunk_tokens: int | None = None,
    ) -> None:
        """`windows`: each KV group's sliding window (None: full attention), one group by
        default. A windowed group needs `max_chunk_tokens`, the most tokens a sequence
        computes in a step, to know the most blocks it holds at once."""
        # no blocks: a scheduler's before its first worker answers (nothing is admitted then)
        if num_blocks < 0 or block_size < 1:
            raise ValueError("num_blocks must be at least 0 and block_size positive")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must list each group's window, None or positive: {windows}")
        if any(w is not None for w in windows) and (max_chunk_tokens or 0) < 1:
            raise ValueError("a windowed group needs max_chunk_tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        # the most blocks a windowed group holds at once: between steps, entries from the
        # window's start, cut by a block boundary, to the end of the next chunk
        self.caps = tuple(
            None if w is None else -(-(w - 1 + (max_chunk_tokens or 0)) // block_size) + 1
            for w in self.windows
        )
        self._groups = range(len(self.windows))
        # popped from the end: recently freed blocks are reused first (warm in caches)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount = [0] * num_blocks
        self._tables: dict[int, list[list[int]]] = {}  # seq_id -> a table per group
        self._dropped: dict[int, list[int]] = {}  # seq_id -> leading entries released, per group
        self._promised: dict[int, int] = {}  # seq_id -> table length promised, while unmet
        self._num_promised = 0  # blocks promised and not yet allocated, over all sequences
        self._block_of: list[dict[bytes, int]] = [{} for _ in self._groups]  # hash -> block
        self._hash_of: dict[int, tuple[int, bytes]] = {}  # registered block -> group, hash
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._registered: dict[int, int] = {}  # seq_id -> leading entries of its tables seen
        self.num_evicted = 0  # cached blocks whose hash was forgotten to reuse them

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: plain free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, held or evictable."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_promised(self) -> int:
        return self._num_promised

    @property
    def num_available(self) -> int:
        """Free blocks not promised to anyone (negative once growth took promised ones)."""
        return self.num_free - self._num_promised

    @property
    def no_hit(self) -> PrefixHit:
        return PrefixHit(((),) * self.num_groups, (0,) * self.num_groups, 0)

    def table(self, seq_id: int, group: int = 0) -> list[int]:
        """The block table of `seq_id` in `group` (empty if it holds none), its dropped
        entries included: entry i is the block of positions i x block_size on. Do not mutate."""
        tables = self._tables.get(seq_id)
        return _EMPTY if tables is None else tables[group]

    def held(self, seq_id: int) -> list[int]:
        """The blocks `seq_id` holds, in all groups: its tables but the dropped entries."""
        tables = self._tables.get(seq_id)
        if tables is None:
            return []
        dropped = self._dropped[seq_id]
        return [block for g in self._groups for block in tables[g][dropped[g] :]]

    def num_held(self, seq_id: int) -> int:
        tables = self._tables.get(seq_id)
        if tables is None:
            return 0
        return sum(len(table) for table in tables) - sum(self._dropped[seq_id])

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def num_promised_to(self, seq_id: int) -> int:
        """Blocks promised to `seq_id` and not yet allocated: each group's entries still to
        come, a windowed group's no more than its cap leaves room for."""
        target = self._promised.get(seq_id)
        if target is None:
            return 0
        return sum(self._owed_in(seq_id, g, target) for g in self._groups)

    def _owed_in(self, seq_id: int, group: int, target: int) -> int:
        table = self.table(seq_id, group)
        to_come = target - len(table)
        cap = self.caps[group]
        if to_come <= 0 or cap is None:
            return max(0, to_come)
        held = len(table) - (self._dropped[seq_id][group] if table else 0)
        return max(0, min(to_come, cap - held))

    def num_claimed(self, seq_id: int) -> int:
        """Blocks `seq_id` holds alone or is promised: what freeing it gives back to
        admission (a block it shares stays held by the others)."""
        alone = sum(1 for block in self.held(seq_id) if self._refcount[block] == 1)
        return alone + self.num_promised_to(seq_id)

    def blocks_to_hold(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once, in all groups."""
        entries = -(-num_tokens // self.block_size)
        return sum(entries if cap is None else min(entries, cap) for cap in self.caps)

    def tokens_fitting(self, num_blocks: int) -> int:
        """The longest sequence whose blocks_to_hold fits in `num_blocks` (sys.maxsize when
        every group is windowed and their caps fit)."""
        if None not in self.caps and sum(self.caps) <= num_blocks:  # type: ignore[arg-type]
            return sys.maxsize
        low, high = 0, max(num_blocks, 0)  # entries: every group holds one at least
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks_to_hold(mid * self.block_size) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low * self.block_size

    def extra_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still needs so that its tables cover `num_tokens` tokens."""
        entries = -(-num_tokens // self.block_size)
        return sum(max(0, entries - len(self.table(seq_id, g))) for g in self._groups)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.extra_blocks(seq_id, num_tokens) <= self.num_free

    @property
    def num_admittable(self) -> int:
        """Blocks a newcomer may take: unpromised, keeping `watermark_blocks` for running
        sequences to grow."""
        return self.num_available - self.watermark_blocks

    def admission_shortfall(self, num_tokens: int, hit: PrefixHit | None = None) -> int:
        """Blocks missing to admit a sequence of `num_tokens` whose first blocks are the
        cached `hit` (<= 0: it fits). A hit block that others hold costs nothing; an
        evictable one leaves the free blocks like a new one."""
        return self.admission_cost(num_tokens, hit) - self.num_admittable

    def admission_cost(self, num_tokens: int, hit: PrefixHit | None = None) -> int:
        """Free blocks a sequence of `num_tokens` takes if it starts with the cached `hit`."""
        blocks = () if hit is None else hit.blocks
        shared = sum(1 for block in blocks if self._refcount[block] > 0)
        return self.blocks_to_hold(num_tokens) - shared

    # ---- the prefix cache ---------------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> PrefixHit:
        """The registered blocks of the longest prefix of `hashes` that every group can
        start from: a full group needs each of its blocks, a windowed group its window's."""
        if not self.enable_caching:
            return self.no_hit
        length = self._longest_hit(hashes)
        if not length:
            return self.no_hit
        first_kept = tuple(self._first_kept(g, length) for g in self._groups)
        tables = tuple(
            tuple(self._block_of[g][digest] for digest in hashes[first_kept[g] : length])
            for g in self._groups
        )
        return PrefixHit(tables, first_kept, length)

    def _longest_hit(self, hashes: Sequence[bytes]) -> int:
        length = len(hashes)
        for g in self._groups:
            if self.windows[g] is None:
                found = self._block_of[g]
                length = next((i for i in range(length) if hashes[i] not in found), length)
        while length:
            # a hit must end before the last entry its windows read that is missing
            gaps = [self._last_gap(g, hashes, length) for g in self._groups if self.windows[g]]
            if max(gaps, default=-1) < 0:
                break
            length = max(gaps)
        return length

    def _last_gap(self, group: int, hashes: Sequence[bytes], length: int) -> int:
        """The last entry a hit of `length` entries reads in windowed `group` that is not
        registered there; -1 when none is missing."""
        found = self._block_of[group]
        for index in range(length - 1, self._first_kept(group, length) - 1, -1):
            if hashes[index] not in found:
                return index
        return -1

    def _first_kept(self, group: int, length: int) -> int:
        """The first table entry a sequence computing from entry `length` on reads in `group`."""
        return first_entry_read(self.windows[group], self.block_size, length * self.block_size)

    def share(self, seq_id: int, hit: PrefixHit) -> None:
        """Start the empty tables of `seq_id` with the cached blocks `hit` (from `match`)."""
        assert not self.table(seq_id), f"sequence {seq_id} shares into a non-empty table"
        if not hit.num_blocks:
            return
        for block in hit.blocks:
            assert block in self._hash_of, f"block {block} is not cached"
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1
        self._tables[seq_id] = [
            [_UNREAD] * first + list(table)
            for first, table in zip(hit.first_kept, hit.tables, strict=True)
        ]
        self._dropped[seq_id] = list(hit.first_kept)
        self._registered[seq_id] = hit.num_blocks

    def register(self, seq_id: int, hashes: Sequence[bytes], num_computed: int) -> None:
        """`seq_id` has computed `num_computed` tokens, whose full blocks' hashes are
        `hashes`: make those blocks findable. A block whose hash another block of its group
        already holds stays unregistered (the first copy serves the matches)."""
        tables = self._tables.get(seq_id)
        if not self.enable_caching or tables is None:
            return
        full = min(num_computed // self.block_size, len(hashes), len(tables[0]))
        seen = self._registered.get(seq_id, 0)
        for g, table in enumerate(tables):
            found = self._block_of[g]
            # a dropped entry's block may be another sequence's now
            for index in range(max(seen, self._dropped[seq_id][g]), full):
                block, digest = table[index], hashes[index]
                if digest not in found and block not in self._hash_of:
                    found[digest] = block
                    self._hash_of[block] = (g, digest)
        if full:
            self._registered[seq_id] = max(full, seen)

    def reset_cache(self) -> int:
        """Forget every registered hash: evictable blocks become plain free, held ones stay
        with their sequences unshared from now on. Returns how many blocks were cached."""
        cached = len(self._hash_of)
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        for found in self._block_of:
            found.clear()
        self._hash_of.clear()
        return cached

    # ---- allocation -----------------------------------------------------------------------

    def allocate_reading(
        self, seq_id: int, num_tokens: int, position: int, hit: PrefixHit | None = None
    ) -> None:
        """Tables for the new sequence `seq_id` covering `num_tokens` tokens whose first
        query is at `position` (K/V pulled from a producer), starting with the cached `hit`:
        a windowed group's entries wholly behind that query's window hold no block, as a
        prefix hit skips them. The caller checks the room first (blocks_to_hold)."""
        assert not self.table(seq_id), f"sequence {seq_id} already has tables"
        if hit is not None and hit.num_blocks:
            self.share(seq_id, hit)
            self.drop_behind_window(seq_id, position)  # hit blocks behind the window
        else:
            self._tables[seq_id] = [[] for _ in self._groups]
            self._dropped[seq_id] = [0] * self.num_groups
        tables, dropped = self._tables[seq_id], self._dropped[seq_id]
        for g, window in enumerate(self.windows):
            first = first_entry_read(window, self.block_size, position)
            if len(tables[g]) < first:
                tables[g] += [_UNREAD] * (first - len(tables[g]))
                dropped[g] = first
        self.allocate(seq_id, num_tokens)

    def reading_tables(
        self, seq_id: int, num_tokens: int, position: int, from_entry: int = 0
    ) -> list[list[int]]:
        """Per group, the blocks of `seq_id`'s first `num_tokens` tokens that a query at
        `position` reads (a full group's all, a windowed group's from its window's on),
        from table entry `from_entry` on."""
        entries = -(-num_tokens // self.block_size)
        tables = []
        for g, window in enumerate(self.windows):
            first = first_entry_read(window, self.block_size, position)
            assert first >= self._dropped[seq_id][g], f"sequence {seq_id} dropped entries read"
            tables.append(self.table(seq_id, g)[max(first, from_entry) : entries])
        return tables

    def promise(self, seq_id: int, num_tokens: int) -> None:
        """Set aside the blocks `seq_id` needs to hold `num_tokens`, allocated later chunk by
        chunk; the promise ends when they are allocated or the sequence is freed."""
        owed_before = self.num_promised_to(seq_id)
        if self.extra_blocks(seq_id, num_tokens):
            self._promised[seq_id] = -(-num_tokens // self.block_size)
        else:
            self._promised.pop(seq_id, None)
        self._num_promised += self.num_promised_to(seq_id) - owed_before

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow the tables of `seq_id` to cover `num_tokens` tokens (a block at each boundary)."""
        extra = self.extra_blocks(seq_id, num_tokens)
        if extra == 0:
            return
        if extra > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {extra} blocks, {self.num_free} free")
        owed_before = self.num_promised_to(seq_id)
        if seq_id not in self._tables:
            self._tables[seq_id] = [[] for _ in self._groups]
            self._dropped[seq_id] = [0] * self.num_groups
        entries = -(-num_tokens // self.block_size)
        for table in self._tables[seq_id]:
            for _ in range(entries - len(table)):
                block = self._take_free_block()
                self._refcount[block] += 1
                table.append(block)
        if self._promised.get(seq_id, 0) <= entries:
            self._promised.pop(seq_id, None)  # met
        self._num_promised += self.num_promised_to(seq_id) - owed_before

    def _take_free_block(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)  # the least recently released
        group, digest = self._hash_of.pop(block)
        del self._block_of[group][digest]
        self.num_evicted += 1
        return block

    def drop_behind_window(self, seq_id: int, position: int) -> int:
        """Release the blocks of `seq_id`'s windowed groups that its next query, at
        `position`, no longer reads (those wholly before position - window + 1); returns
        how many. The tables keep their ids; a promise owes the room they leave again."""
        tables = self._tables.get(seq_id)
        if tables is None or all(window is None for window in self.windows):
            return 0
        owed_before = self.num_promised_to(seq_id)
        dropped = self._dropped[seq_id]
        released: list[int] = []
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            until = min(max(position - window + 1, 0) // self.block_size, len(tables[g]))
            if until > dropped[g]:
                # last first, as free() does: the head of a chain is evicted last
                released += reversed(tables[g][dropped[g] : until])
                dropped[g] = until
        self._release(released)
        self._num_promised += self.num_promised_to(seq_id) - owed_before
        return len(released)

    def trim(self, seq_id: int, num_tokens: int) -> int:
        """Release the table entries of `seq_id` past those `num_tokens` tokens need (a
        step's rejected drafts had them); returns how many. Such a block was written past
        the computed tokens only, so it was never registered: it goes to the free list."""
        tables = self._tables.get(seq_id)
        if tables is None:
            return 0
        entries = max(1, -(-num_tokens // self.block_size))
        released = [table.pop() for table in tables for _ in range(len(table) - entries)]
        self._release(released)
        return len(released)

    def free(self, seq_id: int) -> int:
        """Release every block of `seq_id` and its promise; idempotent. Returns how many
        references dropped. Last entries first (in every group), so a chain's tail is
        evicted before its head, which more sequences share."""
        self._num_promised -= self.num_promised_to(seq_id)
        self._promised.pop(seq_id, None)
        self._registered.pop(seq_id, None)
        tables = self._tables.pop(seq_id, None)
        if tables is None:
            return 0
        dropped = self._dropped.pop(seq_id)
        released = [
            table[index]
            for index in range(len(tables[0]) - 1, -1, -1)
            for table, first in zip(tables, dropped, strict=True)
            if index >= first
        ]
        self._release(released)
        return len(released)

    def _release(self, blocks: Iterable[int]) -> None:
        """One reference less to each of `blocks`, in order: unreferenced, a block goes to
        the free list, or is kept evictable when it holds a hash (released last, evicted
        last)."""
        for block in blocks:
            self._refcount[block] -= 1
            if self._refcount[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ---- invariants -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """free + evictable + held == total, each block in exactly one of them, refcounts
        match the tables, a sequence's tables are equally long, registered hashes map both
        ways, the promised count is the sum of the unmet promises."""
        self._check_promises()
        self._check_cache()
        counted = [0] * self.num_blocks
        for seq_id, tables in self._tables.items():
            if not tables[0]:
                raise BlockAccountingError(f"sequence {seq_id} has an empty table entry")
            if len(tables) != self.num_groups or len({len(t) for t in tables}) != 1:
                raise BlockAccountingError(f"sequence {seq_id}'s tables differ from its groups")
            blocks = self.held(seq_id)
            if len(set(blocks)) != len(blocks):
                raise BlockAccountingError(f"sequence {seq_id} holds a block twice")
            for block in blocks:
                if not 0 <= block < self.num_blocks:
                    raise BlockAccountingError(f"block {block} out of range in seq {seq_id}")
                counted[block] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockAccountingError("a block is on the free list twice")
        for block in range(self.num_blocks):
            if counted[block] != self._refcount[block]:
                raise BlockAccountingError(
                    f"block {block}: refcount {self._refcount[block]} but {counted[block]} owners"
                )
            places = (block in free) + (block in self._evictable) + (counted[block] > 0)
            if places != 1:
                raise BlockAccountingError(
                    f"block {block} is in {places} of free, evictable and held"
                )
        held = sum(1 for c in counted if c)
        if held + self.num_free != self.num_blocks:
            raise BlockAccountingError(
                f"free {len(self._free)} + evictable {len(self._evictable)} + held {held} "
                f"!= total {self.num_blocks}"
            )

    def _check_cache(self) -> None:
        if sum(map(len, self._block_of)) != len(self._hash_of) or any(
            self._block_of[g].get(digest) != block for block, (g, digest) in self._hash_of.items()
        ):
            raise BlockAccountingError("the hash -> block and block -> hash maps disagree")
        for block in self._evictable:
            if block not in self._hash_of:
                raise BlockAccountingError(f"evictable block {block} has no hash")

    def _check_promises(self) -> None:
        for seq_id, target in self._promised.items():
            if target <= len(self.table(seq_id)):
                raise BlockAccountingError(f"sequence {seq_id}: a met promise is still counted")
        owed = sum(self.num_promised_to(seq_id) for seq_id in self._promised)
        if owed != self._num_promised:
            raise BlockAccountingError(f"promised {self._num_promised} but {owed} blocks owed")


_EMPTY: list[int] = []
