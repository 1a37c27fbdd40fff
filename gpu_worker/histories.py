"""Each sequence's tokens so far, kept on the worker for the samplings that read them.

Penalties, bad words and min_tokens depend on a sequence's tokens (SamplingSpec.
reads_history). Shipping them with every plan would grow each step with the sequences'
lengths; instead the worker counts every token a step computes, from the step that begins
a sequence's history (BatchPlan.histories) until the plan that releases it. Every token of a
sequence is computed once per life in the cache (a sampled token is the next step's input),
so after a step's update the counts cover its positions 0 .. end - 1: the tokens the next
token is sampled after. Drafted tokens (BatchPlan.draft_tokens) are the exception: a step
counts them once it keeps them (`keep`), and meanwhile the row that samples after draft t
sees the history and the drafts up to t (`drafted_rows`).

The counts are two tables with a row per tracked sequence, on the model's device:
occurrences among the generated tokens (int32; presence and frequency penalties) and
presence in the prompt or the generated tokens (bool; the repetition penalty, and which
tokens any penalty may touch: a few hundred of a row's vocabulary). They are allocated
when a first sequence asks, so a worker whose requests read no history holds none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.protocol import BatchPlan, History

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

    def update(self, plan: BatchPlan) -> None:
        """Drop the released sequences, begin the plan's new histories, then count the
        step's tokens into every tracked sequence's. ValueError for a sequence that reads
        its history but has none (the service did not begin it)."""
        for seq_id in plan.released:
            self._drop(seq_id)
        for seq_id, history in zip(plan.seq_ids, plan.histories, strict=False):
            if history is not None:
                self._begin(seq_id, history)
        for seq_id, spec in zip(plan.seq_ids, plan.sampling, strict=True):
            if spec.reads_history and seq_id not in self._tracked:
                raise ValueError(f"sequence {seq_id} reads its history, which was never begun")
        if self._tracked:  # else no row reads a history: nothing to count
            self._count_step(plan)

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

    def _begin(self, seq_id: int, history: History) -> None:
        self._drop(seq_id)
        if not self._free:
            self._grow()
        tracked = _Tracked(self._free.pop(), history.prompt_len, [])
        self._tracked[seq_id] = tracked
        self._count([tracked], [history.prefix], [0])

    def _drop(self, seq_id: int) -> None:
        tracked = self._tracked.pop(seq_id, None)
        if tracked is None:
            return
        self.output_counts[tracked.slot] = 0
        self.seen[tracked.slot] = False
        self._free.append(tracked.slot)

    def _grow(self) -> None:
        size = self.output_counts.shape[0]
        added = max(MIN_ROWS, size)
        self.output_counts = torch.cat([self.output_counts, self._zeros(added, torch.int32)])
        self.seen = torch.cat([self.seen, self._zeros(added, torch.bool)])
        self._free.extend(reversed(range(size, size + added)))

    def _zeros(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((rows, self.vocab_size), dtype=dtype, device=self.device)

    def _count_step(self, plan: BatchPlan) -> None:
        """Counts the step's tokens, each sequence's drafts excepted (see `keep`)."""
        tracked, tokens, starts = [], [], []
        drafts = plan.draft_tokens or [[] for _ in plan.seq_ids]
        first = 0
        for seq_id, count, start, draft in zip(
            plan.seq_ids, plan.num_tokens, plan.start_pos, drafts, strict=True
        ):
            entry = self._tracked.get(seq_id)
            if entry is not None:
                tracked.append(entry)
                tokens.append(plan.input_ids[first : first + count - len(draft)])
                starts.append(start)
            first += count
        self._count(tracked, tokens, starts)

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
