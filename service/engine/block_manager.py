"""Paged KV accounting: which of the worker's blocks each sequence owns.

The tensors live in the worker; here are only block ids 0..num_blocks-1. Every block carries
a reference count so that a later prefix cache can share blocks between sequences; today
each block has exactly one owner (refcount 1) or is free (refcount 0).

A sequence admitted on its whole prompt is allocated its blocks chunk by chunk; the blocks
it will still need are *promised* to it, and admission counts only the free blocks nobody
is promised (`num_available`), so two long prompts are never admitted against the same
blocks. A promise binds admission only: growth (`can_grow`) may take any free block.
"""

from __future__ import annotations


class BlockAccountingError(AssertionError):
    """The invariants of the block accounting do not hold (a bug, never user input)."""


class OutOfBlocks(RuntimeError):
    """An allocation asked for more blocks than are free (the scheduler checks first)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        # popped from the end: recently freed blocks are reused first (warm in caches)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._promised: dict[int, int] = {}  # seq_id -> table length promised, while unmet
        self._num_promised = 0  # blocks promised and not yet allocated, over all sequences

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_promised(self) -> int:
        return self._num_promised

    @property
    def num_available(self) -> int:
        """Free blocks not promised to anyone (negative once growth took promised ones)."""
        return len(self._free) - self._num_promised

    def table(self, seq_id: int) -> list[int]:
        """The block table of `seq_id` (empty if it holds none). Do not mutate."""
        return self._tables.get(seq_id, _EMPTY)

    def num_held(self, seq_id: int) -> int:
        return len(self._tables.get(seq_id, _EMPTY))

    def num_promised_to(self, seq_id: int) -> int:
        """Blocks promised to `seq_id` and not yet allocated."""
        target = self._promised.get(seq_id)
        return 0 if target is None else max(0, target - self.num_held(seq_id))

    def num_claimed(self, seq_id: int) -> int:
        """Blocks `seq_id` holds or is promised: what freeing it gives back to admission."""
        return self.num_held(seq_id) + self.num_promised_to(seq_id)

    def blocks_to_hold(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still needs so that its table covers `num_tokens` tokens."""
        return max(0, self.blocks_to_hold(num_tokens) - self.num_held(seq_id))

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.extra_blocks(seq_id, num_tokens) <= len(self._free)

    @property
    def num_admittable(self) -> int:
        """Blocks a newcomer may take: unpromised, keeping `watermark_blocks` for running
        sequences to grow."""
        return self.num_available - self.watermark_blocks

    def admission_shortfall(self, num_tokens: int) -> int:
        """Blocks missing to admit a sequence of `num_tokens` (<= 0: it fits)."""
        return self.blocks_to_hold(num_tokens) - self.num_admittable

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
        if extra > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id} needs {extra} blocks, {len(self._free)} free")
        owed = self.num_promised_to(seq_id)
        table = self._tables.setdefault(seq_id, [])
        for _ in range(extra):
            block = self._free.pop()
            self._refcount[block] += 1
            table.append(block)
        if owed:
            self._keep_promise(seq_id, owed)

    def _keep_promise(self, seq_id: int, owed_before: int) -> None:
        still_owed = self.num_promised_to(seq_id)
        self._num_promised -= owed_before - still_owed
        if not still_owed:
            del self._promised[seq_id]

    def free(self, seq_id: int) -> int:
        """Release every block of `seq_id` and its promise; idempotent. Returns how many
        references dropped."""
        self._num_promised -= self.num_promised_to(seq_id)
        self._promised.pop(seq_id, None)
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        for block in table:
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._free.append(block)
        return len(table)

    def check_invariants(self) -> None:
        """free + owned == total, no double ownership, refcounts match the tables, the
        promised count is the sum of the unmet promises."""
        self._check_promises()
        counted = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            if not table:
                raise BlockAccountingError(f"sequence {seq_id} has an empty table entry")
            for block in table:
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
            if counted[block] > 1:
                raise BlockAccountingError(f"block {block} owned by {counted[block]} sequences")
            if (block in free) == (counted[block] > 0):
                raise BlockAccountingError(f"block {block} is both free and owned, or neither")
        owned = sum(1 for c in counted if c)
        if owned + len(self._free) != self.num_blocks:
            raise BlockAccountingError(
                f"free {len(self._free)} + owned {owned} != total {self.num_blocks}"
            )

    def _check_promises(self) -> None:
        for seq_id, target in self._promised.items():
            if target <= self.num_held(seq_id):
                raise BlockAccountingError(f"sequence {seq_id}: a met promise is still counted")
        owed = sum(self.num_promised_to(seq_id) for seq_id in self._promised)
        if owed != self._num_promised:
            raise BlockAccountingError(f"promised {self._num_promised} but {owed} blocks owed")


_EMPTY: list[int] = []
