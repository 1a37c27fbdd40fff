"""The worker's memory of each sequence it holds: one owner of every per-sequence fact.

A sequence is introduced once (StepPlan.new: its SamplingSpec, prompt length, pooling, the
prefix its history starts with) and forgotten when a plan lists it in `finished`; in
between, each of its rows adds only what changed. Its block tables, one per KV group, live
in one tensor [G, slots, W] on the model's device, padded with the scratch block: a row's
new block ids are written into its sequence's slot, never rebuilt, so a step's tables are
one gather (`tables`) whatever the contexts' length. Its row PAD_SLOT belongs to no
sequence and names only the scratch block: a decode step's padding rows read it
(gpu_worker.staging). Tensor-parallel followers apply the same plans and hold the same
tables.

Histories. Penalties, bad words and min_tokens depend on a sequence's tokens (SamplingSpec.
reads_history). Shipping them with every plan would grow each step with the sequences'
lengths; instead the worker counts every token a step computes, from the plan that
introduces a sequence (with the prefix a cache hit skipped) until the plan that finishes
it. Every token of a sequence is computed once per life in the cache (a sampled token is
the next step's input), so after a step's count the counts cover its positions
0 .. end - 1: the tokens the next token is sampled after. Drafted tokens (Row.drafts) are
the exception: a step counts them once it keeps them (`keep`), and meanwhile the row that
samples after draft t sees the history and the drafts up to t (`drafted_rows`).

The counts are two tables with a row per tracked sequence, on the model's device:
occurrences among the generated tokens (int32; presence and frequency penalties) and
presence in the prompt or the generated tokens (bool; the repetition penalty, and which
tokens any penalty may touch: a few hundred of a row's vocabulary). They are allocated
when a first sequence asks, so a worker whose requests read no history holds none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.protocol import (
    DRAFT_MODEL_TOKEN,
    POOL_LAST,
    POOL_SUM,
    NewSeq,
    Row,
    SamplingSpec,
    StepPlan,
)


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """What a plan may ask of this worker: its cache and its model."""

    block_size: int
    num_blocks: int  # the cache's blocks a table may name (the scratch block is not one)
    vocab_size: int
    max_model_len: int
    num_groups: int = 1  # the cache's KV groups: a sequence has a table per group

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def scratch_block(self) -> int:
        """The block past the service's (gpu_worker.kv_cache): padding reads and writes it."""
        return self.num_blocks


@dataclass(slots=True)
class Seq:
    """What the worker holds of one sequence."""

    slot: int  # its row of the block tables
    sampling: SamplingSpec
    prompt_len: int
    pooling: str | None
    adapter: str | None
    num_blocks: int = 0  # entries of its tables in use (every group's are as long)


PAD_SLOT = 0  # the tables' row of no sequence: every entry the scratch block


class SeqTable:
    def __init__(self, limits: PlanLimits, device: torch.device) -> None:
        self.limits = limits
        self.device = device
        self._seqs: dict[int, Seq] = {}
        self._free: list[int] = []
        shape = (limits.num_groups, PAD_SLOT + 1, limits.max_blocks_per_seq)
        self.tables = torch.full(shape, limits.scratch_block, dtype=torch.long, device=device)
        self.histories = Histories(limits.vocab_size, device)
        # told each slot given to a sequence: the linear-attention layers' states, kept in
        # the same rows (gpu_worker.recurrent_state), start it from zeros
        self.slot_given: Callable[[int], None] | None = None

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq(self, seq_id: int) -> Seq:
        return self._seqs[seq_id]

    def table(self, seq_id: int, group: int = 0) -> list[int]:
        """A sequence's block table in `group` (tests and the simulated worker read it)."""
        seq = self._seqs[seq_id]
        return self.tables[group, seq.slot, : seq.num_blocks].tolist()

    def apply(self, plan: StepPlan) -> None:
        """Forget `finished`, introduce `new`, write each row's new block ids. ValueError,
        before anything changes, for a plan that does not fit what the worker holds."""
        self.check(plan)
        for seq_id in plan.finished:
            self._forget(seq_id)
        for new in plan.new:
            self._introduce(new)
        self._write_blocks(plan.rows)

    def clear(self) -> None:
        """Forget every sequence (the start-up's trial steps)."""
        for seq_id in list(self._seqs):
            self._forget(seq_id)

    def check(self, plan: StepPlan) -> None:
        """The plan's rows against what the worker will hold once `finished` and `new` are
        applied; per row, never per table entry."""
        limits = self.limits
        gone = set(plan.finished)
        introduced = {new.seq_id: new for new in plan.new}
        if len(introduced) != len(plan.new):
            raise ValueError("plan introduces a sequence twice")
        for new in plan.new:
            _check_new(new)
        seq_ids = plan.seq_ids
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("plan lists a sequence more than once")
        appended: list[int] = []
        for row in plan.rows:
            held = self._seqs.get(row.seq_id)
            if row.seq_id in introduced or row.seq_id in gone:
                held = None
                if row.seq_id not in introduced:
                    raise ValueError(f"sequence {row.seq_id} is finished and runs in one plan")
            elif held is None:
                raise ValueError(f"sequence {row.seq_id} was never introduced to this worker")
            entries = _entries_after(row, 0 if held is None else held.num_blocks, limits)
            _check_row(row, entries, limits)
            pooled = introduced[row.seq_id].pooling if held is None else held.pooling
            if pooled is not None and row.sample:
                raise ValueError(f"sequence {row.seq_id} is pooled and sampled; a step does one")
            for group in row.blocks:
                appended += group
        if appended and (min(appended) < 0 or max(appended) >= limits.num_blocks):
            raise ValueError(
                f"block ids must lie in 0..{limits.num_blocks - 1}, "
                f"got {min(appended)}..{max(appended)}"
            )
        if sum(plan.num_tokens) != len(plan.input_ids):
            raise ValueError(
                f"rows add up to {sum(plan.num_tokens)} tokens but input_ids has "
                f"{len(plan.input_ids)}"
            )
        _check_token_ids(plan, limits.vocab_size)

    def _introduce(self, new: NewSeq) -> None:
        self._forget(new.seq_id)
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._seqs[new.seq_id] = Seq(slot, new.sampling, new.prompt_len, new.pooling, new.adapter)
        if self.slot_given is not None:
            self.slot_given(slot)
        if new.sampling.reads_history:
            self.histories.begin(new.seq_id, new.prompt_len, new.prefix)

    def _forget(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self.tables[:, seq.slot, : seq.num_blocks] = self.limits.scratch_block
        self._free.append(seq.slot)
        self.histories.drop(seq_id)

    @torch.inference_mode(False)  # they outlive the step that grows them
    def _grow(self) -> None:
        groups, size, width = self.tables.shape
        added = max(MIN_ROWS, size)
        more = torch.full(
            (groups, added, width), self.limits.scratch_block, dtype=torch.long, device=self.device
        )
        self.tables = torch.cat([self.tables, more], dim=1)
        self._free.extend(reversed(range(size, size + added)))

    def _write_blocks(self, rows: list[Row]) -> None:
        """Every row's new entries in one indexed write: a single copy to the device."""
        groups: list[int] = []
        slots: list[int] = []
        entries: list[int] = []
        ids: list[int] = []
        for row in rows:
            seq = self._seqs[row.seq_id]
            at = seq.num_blocks if row.blocks_at is None else row.blocks_at
            added = len(row.blocks[0]) if row.blocks else 0
            if at + added < seq.num_blocks:  # entries given back: padding again
                self.tables[:, seq.slot, at + added : seq.num_blocks] = self.limits.scratch_block
            seq.num_blocks = at + added
            for g, blocks in enumerate(row.blocks):
                groups += [g] * added
                slots += [seq.slot] * added
                entries += range(at, at + added)
                ids += blocks
        if ids:
            index = torch.tensor([groups, slots, entries, ids], dtype=torch.long)
            index = index.to(self.device, non_blocking=True)
            self.tables[index[0], index[1], index[2]] = index[3]


def _entries_after(row: Row, held: int, limits: PlanLimits) -> int:
    """How many table entries the row's sequence has once its blocks are written."""
    at = held if row.blocks_at is None else row.blocks_at
    if not 0 <= at <= held:
        raise ValueError(
            f"sequence {row.seq_id}'s blocks go at entry {at}, but its table has {held}"
        )
    if row.blocks and (
        len(row.blocks) != limits.num_groups
        or any(len(group) != len(row.blocks[0]) for group in row.blocks)
    ):
        raise ValueError(
            f"sequence {row.seq_id} adds blocks to {len(row.blocks)} groups of unequal "
            f"length; the cache has {limits.num_groups} KV groups, whose tables grow together"
        )
    return at + (len(row.blocks[0]) if row.blocks else 0)


def _check_row(row: Row, entries: int, limits: PlanLimits) -> None:
    if row.num_tokens < 1:
        raise ValueError(
            f"sequence {row.seq_id} has {row.num_tokens} tokens; each needs at least one"
        )
    if row.start_pos < 0:
        raise ValueError(f"sequence {row.seq_id} starts at negative position {row.start_pos}")
    end = row.start_pos + row.num_tokens
    if end > limits.max_model_len:
        raise ValueError(
            f"sequence {row.seq_id} reaches {end} tokens, beyond max_model_len "
            f"{limits.max_model_len}"
        )
    if entries * limits.block_size < end:
        raise ValueError(
            f"sequence {row.seq_id} needs {-(-end // limits.block_size)} blocks for {end} "
            f"tokens but its block table has {entries}"
        )
    targets = row.prompt_targets
    if targets is not None:
        if len(targets) > row.num_tokens:
            raise ValueError(
                f"sequence {row.seq_id} has {len(targets)} prompt targets for "
                f"{row.num_tokens} positions"
            )
        if targets and (min(targets) < 0 or max(targets) >= limits.vocab_size):
            raise ValueError(f"prompt targets must lie in 0..{limits.vocab_size - 1}")


def _check_token_ids(plan: StepPlan, vocab_size: int) -> None:
    """Ids of the vocabulary, and DRAFT_MODEL_TOKEN as many times as drafts hold it (the
    draft model puts its tokens there)."""
    ids = plan.input_ids
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    placeholders = sum(row.drafts.count(DRAFT_MODEL_TOKEN) for row in plan.rows)
    if (
        min(ids) < DRAFT_MODEL_TOKEN
        or max(ids) >= vocab_size
        or (ids.count(DRAFT_MODEL_TOKEN) != placeholders)
    ):
        raise ValueError(f"token ids must lie in 0..{vocab_size - 1}")


def _check_new(new: NewSeq) -> None:
    if new.pooling not in (None, POOL_LAST, POOL_SUM):
        raise ValueError(f"sequence {new.seq_id} has pooling {new.pooling!r}; not one of last, sum")
    if new.prompt_len < 0:
        raise ValueError(f"sequence {new.seq_id} has a negative prompt length")


MIN_ROWS = 8  # the tables' first size; they double as sequences arrive


@dataclass(slots=True)
class RowTokens:
    """What a step's sampled rows that read their history have seen (Histories.rows): row
    i of the batch `rows[i]` has its counts in row `slots[i]` of the tables."""

    rows: list[int]  # rows of the sampled batch
    slots: torch.Tensor  # long [len(rows)]
    output_counts: torch.Tensor  # int32 [tracked, vocab]: occurrences among generated tokens
    seen: torch.Tensor  # bool [tracked, vocab]: in the prompt or generated
    generated: list[list[int]]  # each row's generated tokens, in order (bad words read the tail)


@dataclass(slots=True)
class _Tracked:
    slot: int  # its row of the tables
    prompt_len: int
    generated: list[int]


class Histories:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._tracked: dict[int, _Tracked] = {}  # by seq_id
        self._free: list[int] = []
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)

    def __len__(self) -> int:
        return len(self._tracked)

    def count_step(self, plan: StepPlan) -> None:
        """Counts the step's tokens into every tracked sequence's, each row's drafts
        excepted (see `keep`)."""
        if not self._tracked:
            return
        tracked, tokens, starts = [], [], []
        first = 0
        for row in plan.rows:
            entry = self._tracked.get(row.seq_id)
            if entry is not None:
                tracked.append(entry)
                tokens.append(plan.input_ids[first : first + row.num_tokens - len(row.drafts)])
                starts.append(row.start_pos)
            first += row.num_tokens
        self._count(tracked, tokens, starts)

    def rows(self, seq_ids: list[int]) -> RowTokens | None:
        """The tracked ones of `seq_ids` (a step's sampled sequences, in row order)."""
        found = [(row, self._tracked.get(seq_id)) for row, seq_id in enumerate(seq_ids)]
        tracked = [(row, t) for row, t in found if t is not None]
        if not tracked:
            return None
        return RowTokens(
            rows=[row for row, _ in tracked],
            slots=torch.tensor([t.slot for _, t in tracked], device=self.device),
            output_counts=self.output_counts,
            seen=self.seen,
            generated=[t.generated for _, t in tracked],
        )

    def drafted_rows(self, seq_ids: list[int], drafts: list[list[int]]) -> RowTokens | None:
        """rows(seq_ids) for a step whose sequence i samples at len(drafts[i]) + 1 rows, in
        order: its row t sees its history and its first t drafts (as generated tokens: a
        sequence drafts once it decodes), in copies of its rows of the tables."""
        rows: list[int] = []  # of the sampling rows
        slots: list[int] = []
        generated: list[list[int]] = []
        copies: list[int] = []  # each draft token a copy adds, by copy
        ids: list[int] = []
        first = 0
        for seq_id, draft in zip(seq_ids, drafts, strict=True):
            tracked = self._tracked.get(seq_id)
            if tracked is not None:
                for t in range(len(draft) + 1):
                    copies += [len(rows)] * t
                    ids += draft[:t]
                    rows.append(first + t)
                    slots.append(tracked.slot)
                    generated.append(tracked.generated + draft[:t])
            first += len(draft) + 1
        if not rows:
            return None
        index = torch.tensor(slots, device=self.device)
        counts, seen = self.output_counts[index], self.seen[index]  # copies: advanced indexing
        if ids:
            added = self._index(copies, ids)
            ones = torch.ones(len(ids), dtype=torch.int32, device=self.device)
            counts.index_put_(added, ones, accumulate=True)
            seen[added] = True
        return RowTokens(rows, torch.arange(len(rows), device=self.device), counts, seen, generated)

    def keep(self, seq_ids: list[int], kept: list[list[int]], starts: list[int]) -> None:
        """Counts the drafts each sequence kept, kept[i], which sit from position starts[i]."""
        tracked, tokens, positions = [], [], []
        for seq_id, found, start in zip(seq_ids, kept, starts, strict=True):
            entry = self._tracked.get(seq_id)
            if entry is not None:
                tracked.append(entry)
                tokens.append(found)
                positions.append(start)
        self._count(tracked, tokens, positions)

    def begin(self, seq_id: int, prompt_len: int, prefix: list[int]) -> None:
        """Tracks a sequence from `prefix`, the tokens before its first row."""
        self.drop(seq_id)
        if not self._free:
            self._grow()
        tracked = _Tracked(self._free.pop(), prompt_len, [])
        self._tracked[seq_id] = tracked
        self._count([tracked], [prefix], [0])

    def drop(self, seq_id: int) -> None:
        tracked = self._tracked.pop(seq_id, None)
        if tracked is None:
            return
        self.output_counts[tracked.slot] = 0
        self.seen[tracked.slot] = False
        self._free.append(tracked.slot)

    @torch.inference_mode(False)  # they outlive the step that grows them
    def _grow(self) -> None:
        size = self.output_counts.shape[0]
        added = max(MIN_ROWS, size)
        self.output_counts = torch.cat([self.output_counts, self._zeros(added, torch.int32)])
        self.seen = torch.cat([self.seen, self._zeros(added, torch.bool)])
        self._free.extend(reversed(range(size, size + added)))

    def _zeros(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((rows, self.vocab_size), dtype=dtype, device=self.device)

    def _count(self, tracked: list[_Tracked], tokens: list[list[int]], starts: list[int]) -> None:
        """Adds tokens[i], which sit from position starts[i] of tracked[i]'s sequence, to its
        counts: all as seen, those from its prompt_len on as generated too."""
        slots, ids, output_slots, output_ids = [], [], [], []
        for entry, found, start in zip(tracked, tokens, starts, strict=True):
            split = max(0, min(len(found), entry.prompt_len - start))
            slots += [entry.slot] * len(found)
            ids += found
            output_slots += [entry.slot] * (len(found) - split)
            output_ids += found[split:]
            entry.generated += found[split:]
        if ids:
            true = torch.ones((), dtype=torch.bool, device=self.device)
            self.seen.index_put_(self._index(slots, ids), true)
        if output_ids:
            index = self._index(output_slots, output_ids)
            ones = torch.ones(len(output_ids), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, ones, accumulate=True)

    def _index(self, slots: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = torch.tensor([slots, ids], dtype=torch.long).to(self.device, non_blocking=True)
        return pairs[0], pairs[1]
