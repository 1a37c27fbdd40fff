"""Paged KV accounting: which of the worker's blocks each sequence holds, and the prefix cache.

The tensors live in the worker; here are only block ids 0..num_blocks-1, each with a
reference count: the number of sequences whose table holds it.

Prefix caching. A block that a sequence has filled and computed is registered under a hash
chained from its parent's (`chain_hashes`): the hash names the block's tokens and every
token before them, so equal hashes mean equal K/V. A newcomer's longest registered prefix
is `match`ed and `share`d: its table starts with those blocks (reference counted, never
written again: a sequence only writes past its computed tokens, which start after them).
A released block that holds a hash is kept, *evictable*, in least-recently-released order
instead of going to the free list; it is taken back by a later match, or evicted (its hash
forgotten) when an allocation finds no plain free block. Both kinds count as free.

A sequence admitted on its whole prompt is allocated its blocks chunk by chunk; the blocks
it will still need are *promised* to it, and admission counts only the free blocks nobody
is promised (`num_available`), so two long prompts are never admitted against the same
blocks. A promise binds admission only: growth (`can_grow`) may take any free block.

Sliding windows. On a model whose every layer attends within a window, the blocks wholly
before a sequence's window are never read again: `drop_before` releases them (to the free
list, or evictable when cached). Its table keeps their ids at their places, so positions
still index it, but they are no longer its blocks (`held` is the rest): another sequence
may take one, and its keys there are masked out by the window.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Iterable, Sequence


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


def _root(salt: str | None) -> bytes:
    """The first block's parent: nothing, or the salt's own hash."""
    return b"" if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode()).digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.0,
        enable_caching: bool = True,
    ) -> None:
        # no blocks: a scheduler's before its first worker answers (nothing is admitted then)
        if num_blocks < 0 or block_size < 1:
            raise ValueError("num_blocks must be at least 0 and block_size positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_caching = enable_caching
        # popped from the end: recently freed blocks are reused first (warm in caches)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._dropped: dict[int, int] = {}  # seq_id -> leading table entries released
        self._promised: dict[int, int] = {}  # seq_id -> table length promised, while unmet
        self._num_promised = 0  # blocks promised and not yet allocated, over all sequences
        self._block_of: dict[bytes, int] = {}  # registered hash -> its block
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._registered: dict[int, int] = {}  # seq_id -> leading blocks of its table seen
        self.num_evicted = 0  # cached blocks whose hash was forgotten to reuse them

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

    def table(self, seq_id: int) -> list[int]:
        """The block table of `seq_id` (empty if it holds none), its dropped entries
        included: entry i is the block of positions i x block_size on. Do not mutate."""
        return self._tables.get(seq_id, _EMPTY)

    def held(self, seq_id: int) -> list[int]:
        """The blocks `seq_id` holds: its table but the dropped entries."""
        return self.table(seq_id)[self._dropped.get(seq_id, 0) :]

    def num_held(self, seq_id: int) -> int:
        return len(self.table(seq_id)) - self._dropped.get(seq_id, 0)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def num_promised_to(self, seq_id: int) -> int:
        """Blocks promised to `seq_id` and not yet allocated."""
        target = self._promised.get(seq_id)
        return 0 if target is None else max(0, target - len(self.table(seq_id)))

    def num_claimed(self, seq_id: int) -> int:
        """Blocks `seq_id` holds alone or is promised: what freeing it gives back to
        admission (a block it shares stays held by the others)."""
        alone = sum(1 for block in self.held(seq_id) if self._refcount[block] == 1)
        return alone + self.num_promised_to(seq_id)

    def blocks_to_hold(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still needs so that its table covers `num_tokens` tokens."""
        return max(0, self.blocks_to_hold(num_tokens) - len(self.table(seq_id)))

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.extra_blocks(seq_id, num_tokens) <= self.num_free

    @property
    def num_admittable(self) -> int:
        """Blocks a newcomer may take: unpromised, keeping `watermark_blocks` for running
        sequences to grow."""
        return self.num_available - self.watermark_blocks

    def admission_shortfall(self, num_tokens: int, hit: Sequence[int] = ()) -> int:
        """Blocks missing to admit a sequence of `num_tokens` whose first blocks are the
        cached `hit` (<= 0: it fits). A hit block that others hold costs nothing; an
        evictable one leaves the free blocks like a new one."""
        return self.admission_cost(num_tokens, hit) - self.num_admittable

    def admission_cost(self, num_tokens: int, hit: Sequence[int] = ()) -> int:
        """Free blocks a sequence of `num_tokens` takes if it starts with the cached `hit`."""
        shared = sum(1 for block in hit if self._refcount[block] > 0)
        return self.blocks_to_hold(num_tokens) - shared

    # ---- the prefix cache ---------------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of `hashes`."""
        if not self.enable_caching:
            return []
        hit = []
        for digest in hashes:
            block = self._block_of.get(digest)
            if block is None:
                break
            hit.append(block)
        return hit

    def share(self, seq_id: int, hit: Sequence[int]) -> None:
        """Start the empty table of `seq_id` with the cached blocks `hit` (from `match`)."""
        assert not self.table(seq_id), f"sequence {seq_id} shares into a non-empty table"
        if not hit:
            return
        for block in hit:
            assert block in self._hash_of, f"block {block} is not cached"
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1
        self._tables[seq_id] = list(hit)
        self._registered[seq_id] = len(hit)

    def register(self, seq_id: int, hashes: Sequence[bytes], num_computed: int) -> None:
        """`seq_id` has computed `num_computed` tokens, whose full blocks' hashes are
        `hashes`: make those blocks findable. A block whose hash another block already
        holds stays unregistered (the first copy serves the matches)."""
        if not self.enable_caching:
            return
        table = self.table(seq_id)
        full = min(num_computed // self.block_size, len(hashes), len(table))
        # a dropped entry's block may be another sequence's now
        first = max(self._registered.get(seq_id, 0), self._dropped.get(seq_id, 0))
        for index in range(first, full):
            block, digest = table[index], hashes[index]
            if digest not in self._block_of and block not in self._hash_of:
                self._block_of[digest] = block
                self._hash_of[block] = digest
        if full:
            self._registered[seq_id] = max(full, self._registered.get(seq_id, 0))

    def reset_cache(self) -> int:
        """Forget every registered hash: evictable blocks become plain free, held ones stay
        with their sequences unshared from now on. Returns how many blocks were cached."""
        cached = len(self._hash_of)
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()
        return cached

    # ---- allocation -----------------------------------------------------------------------

    def promise(self, seq_id: int, num_tokens: int) -> None:
        """Set aside the blocks `seq_id` needs to hold `num_tokens`, allocated later chunk by
        chunk; the promise ends when they are allocated or the sequence is freed."""
        owed = self.extra_blocks(seq_id, num_tokens)
        self._num_promised += owed - self.num_promised_to(seq_id)
        if owed:
            self._promised[seq_id] = self.blocks_to_hold(num_tokens)
        else:
            self._promised.pop(seq_id, None)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow the table of `seq_id` to cover `num_tokens` tokens (a block at each boundary)."""
        extra = self.extra_blocks(seq_id, num_tokens)
        if extra == 0:
            return
        if extra > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {extra} blocks, {self.num_free} free")
        owed = self.num_promised_to(seq_id)
        table = self._tables.setdefault(seq_id, [])
        for _ in range(extra):
            block = self._take_free_block()
            self._refcount[block] += 1
            table.append(block)
        if owed:
            self._keep_promise(seq_id, owed)

    def _take_free_block(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)  # the least recently released
        del self._block_of[self._hash_of.pop(block)]
        self.num_evicted += 1
        return block

    def _keep_promise(self, seq_id: int, owed_before: int) -> None:
        still_owed = self.num_promised_to(seq_id)
        self._num_promised -= owed_before - still_owed
        if not still_owed:
            del self._promised[seq_id]

    def drop_before(self, seq_id: int, position: int) -> int:
        """Release the blocks of `seq_id` that hold only positions before `position` (its
        window no longer reaches them); returns how many. First blocks first: evicted
        before the later ones of a chain, they are the least useful to a prefix match."""
        dropped = self._dropped.get(seq_id, 0)
        table = self.table(seq_id)
        until = min(max(position, 0) // self.block_size, len(table))
        if until <= dropped:
            return 0
        self._release(reversed(table[dropped:until]))
        self._dropped[seq_id] = until
        return until - dropped

    def free(self, seq_id: int) -> int:
        """Release every block of `seq_id` and its promise; idempotent. Returns how many
        references dropped. Last blocks first, so a chain's tail is evicted before its
        head, which more sequences share."""
        self._num_promised -= self.num_promised_to(seq_id)
        self._promised.pop(seq_id, None)
        self._registered.pop(seq_id, None)
        held = self.held(seq_id)
        self._tables.pop(seq_id, None)
        self._dropped.pop(seq_id, None)
        self._release(reversed(held))
        return len(held)

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
        match the tables, registered hashes map both ways, the promised count is the sum of
        the unmet promises."""
        self._check_promises()
        self._check_cache()
        counted = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            if not table:
                raise BlockAccountingError(f"sequence {seq_id} has an empty table entry")
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
        if len(self._block_of) != len(self._hash_of) or any(
            self._block_of.get(digest) != block for block, digest in self._hash_of.items()
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
