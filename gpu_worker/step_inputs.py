"""The spine of a step: every per-row fact of one BatchPlan, derived once, after its check.

A plan lists sequences; the model sees rows (tokens). Which rows belong to which sequence,
their absolute positions, their cache slots and each sequence's padded block table in each
KV group (gpu_worker.kv_groups: one for most models), which sequences sample and from
which row, which are single-token (decode) rows: every part of the worker (attention
metadata, the eager and the graph-replayed forward, the sampler) reads these facts from a
StepInputs and derives none of them itself.

A decode-only step is padded to a batch bucket and a table width (gpu_worker.graphs):
`decode_tensors` builds those padded tensors, whose padding rows write and read only the
scratch block, from the same facts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpu_worker.protocol import POOL_LAST, POOL_SUM, BatchPlan, SamplingSpec


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """What a plan may ask of this worker: its cache and its model."""

    block_size: int
    num_blocks: int  # the cache's blocks a table may name (the scratch block is not one)
    vocab_size: int
    max_model_len: int
    num_groups: int = 1  # the cache's KV groups: a plan has a table per group


@dataclass(slots=True)
class StepInputs:
    plan: BatchPlan
    block_size: int
    scratch_block: int
    first_rows: torch.Tensor  # [S] each sequence's first row in the flattened batch
    positions: torch.Tensor  # [T] each row's absolute position
    tables: torch.Tensor  # [G, S, W] each group's block tables, padded with the scratch block
    slots: torch.Tensor  # [G, T] the cache slot each row's K/V is written to, in each group
    sampled: list[int]  # the sequences that sample, in plan order

    @classmethod
    def of(cls, plan: BatchPlan, limits: PlanLimits, scratch_block: int) -> StepInputs:
        """The plan's facts; ValueError (from check_plan) when the plan is inconsistent."""
        check_plan(plan, limits)
        bs = limits.block_size
        counts = torch.tensor(plan.num_tokens, dtype=torch.long)
        first_rows = torch.cumsum(counts, 0) - counts
        seq_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
        offsets = torch.arange(plan.total_tokens) - first_rows[seq_of_row]
        positions = torch.tensor(plan.start_pos, dtype=torch.long)[seq_of_row] + offsets
        width = max((len(t) for t in plan.block_tables), default=1)
        tables = torch.tensor(
            [
                [t + [scratch_block] * (width - len(t)) for t in group]
                for group in _group_major(plan)
            ],
            dtype=torch.long,
        ).view(limits.num_groups, len(counts), width)
        slots = tables[:, seq_of_row, positions // bs] * bs + positions % bs
        sampled = [i for i, wanted in enumerate(plan.sample) if wanted]
        return cls(plan, bs, scratch_block, first_rows, positions, tables, slots, sampled)

    @property
    def num_seqs(self) -> int:
        return len(self.plan.seq_ids)

    @property
    def decode_only(self) -> bool:
        """Every sequence adds one token: the step graphs.DecodeRunner pads and replays."""
        return self.plan.is_decode_only

    def is_decode(self, seq: int) -> bool:
        return self.plan.num_tokens[seq] == 1

    def ends(self, seqs: list[int]) -> list[int]:
        """Each sequence's length after this step (the position its next token takes)."""
        plan = self.plan
        return [plan.start_pos[i] + plan.num_tokens[i] for i in seqs]

    def last_rows(self, seqs: list[int]) -> torch.Tensor:
        """The row of each sequence's last token (the one that samples)."""
        counts = torch.tensor(self.plan.num_tokens, dtype=torch.long)
        return (self.first_rows + counts - 1)[seqs]

    def sampling(self) -> list[SamplingSpec]:
        """The sampled sequences' settings, in plan order."""
        return [self.plan.sampling[i] for i in self.sampled]

    def decode_tensors(
        self, batch: int, width: int, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """A decode-only step's (input_ids, positions, slots [G, B], tables [G, B, W],
        context_lens) for `batch` rows and tables `width` wide (graphs.decode_forward's
        inputs)."""
        rows = self.plan.total_tokens
        return _decode_tensors(
            self.plan.input_ids,
            self.positions.tolist(),
            self.slots.tolist(),
            self.tables[:, :rows, :width].tolist(),
            self.block_size,
            self.scratch_block,
            batch,
            width,
            device,
        )


def padding_tensors(
    block_size: int,
    scratch_block: int,
    batch: int,
    width: int,
    device: torch.device,
    num_groups: int = 1,
) -> tuple[torch.Tensor, ...]:
    """decode_tensors of a step with no sequence: `batch` padding rows (graph capture)."""
    nothing: list[list[int]] = [[] for _ in range(num_groups)]
    return _decode_tensors(
        [],
        [],
        nothing,
        [[] for _ in range(num_groups)],
        block_size,
        scratch_block,
        batch,
        width,
        device,
    )


def _group_major(plan: BatchPlan) -> list[list[list[int]]]:
    """The plan's tables by group, then sequence."""
    return [plan.block_tables] + [list(group) for group in zip(*plan.group_tables, strict=True)]


def _decode_tensors(
    input_ids: list[int],
    positions: list[int],
    slots: list[list[int]],
    tables: list[list[list[int]]],
    block_size: int,
    scratch: int,
    batch: int,
    width: int,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """Rows beyond the step's own, and table entries beyond a row's own, point at the
    scratch block, with context length 1."""
    pad = batch - len(input_ids)
    host = (
        input_ids + [0] * pad,
        positions + [0] * pad,
        [group + [scratch * block_size] * pad for group in slots],
        [
            [t + [scratch] * (width - len(t)) for t in group] + [[scratch] * width] * pad
            for group in tables
        ],
        [p + 1 for p in positions] + [1] * pad,
    )
    return tuple(torch.tensor(values, dtype=torch.long, device=device) for values in host)


def check_plan(plan: BatchPlan, limits: PlanLimits) -> None:
    """Cheap consistency checks (per sequence, not per token); ValueError says what is wrong."""
    count = len(plan.seq_ids)
    for name in ("num_tokens", "start_pos", "block_tables", "sample", "sampling"):
        if len(getattr(plan, name)) != count:
            raise ValueError(f"plan has {count} seq_ids but {len(getattr(plan, name))} {name}")
    for name in ("token_bitmasks", "histories", "pooling", "group_tables"):
        if getattr(plan, name) and len(getattr(plan, name)) != count:
            raise ValueError(f"plan has {count} seq_ids but {len(getattr(plan, name))} {name}")
    if len(set(plan.seq_ids)) != count:
        raise ValueError("plan lists a sequence more than once")
    for seq_id, tokens, start, table in zip(
        plan.seq_ids, plan.num_tokens, plan.start_pos, plan.block_tables, strict=True
    ):
        _check_sequence(seq_id, tokens, start, len(table), limits)
    if sum(plan.num_tokens) != len(plan.input_ids):
        raise ValueError(
            f"num_tokens add up to {sum(plan.num_tokens)} but input_ids has {len(plan.input_ids)}"
        )
    _check_group_tables(plan, limits.num_groups)
    used = [block for group in _group_major(plan) for table in group for block in table]
    if used and (min(used) < 0 or max(used) >= limits.num_blocks):
        raise ValueError(
            f"block ids must lie in 0..{limits.num_blocks - 1}, got {min(used)}..{max(used)}"
        )
    vocab_size = limits.vocab_size
    if plan.input_ids and (min(plan.input_ids) < 0 or max(plan.input_ids) >= vocab_size):
        raise ValueError(f"token ids must lie in 0..{vocab_size - 1}")
    if plan.prompt_targets:
        _check_prompt_targets(plan, vocab_size)
    if plan.pooling:
        _check_pooling(plan)


def _check_group_tables(plan: BatchPlan, num_groups: int) -> None:
    if not plan.group_tables:
        if num_groups > 1:
            raise ValueError(f"the cache has {num_groups} KV groups: a plan needs their tables")
        return
    for seq_id, table, others in zip(
        plan.seq_ids, plan.block_tables, plan.group_tables, strict=True
    ):
        if len(others) != num_groups - 1 or any(len(t) != len(table) for t in others):
            raise ValueError(
                f"sequence {seq_id} needs {num_groups - 1} more tables as long as its first"
            )


def _check_pooling(plan: BatchPlan) -> None:
    for seq_id, kind, samples in zip(plan.seq_ids, plan.pooling, plan.sample, strict=True):
        if kind not in (None, POOL_LAST, POOL_SUM):
            raise ValueError(f"sequence {seq_id} has pooling {kind!r}; not one of last, sum")
        if kind is not None and samples:
            raise ValueError(f"sequence {seq_id} is pooled and sampled; a step does one")


def _check_prompt_targets(plan: BatchPlan, vocab_size: int) -> None:
    if len(plan.prompt_targets) != len(plan.seq_ids):
        raise ValueError(
            f"plan has {len(plan.seq_ids)} seq_ids but {len(plan.prompt_targets)} prompt_targets"
        )
    for seq_id, targets, tokens in zip(
        plan.seq_ids, plan.prompt_targets, plan.num_tokens, strict=True
    ):
        if targets is None:
            continue
        if len(targets) > tokens:
            raise ValueError(
                f"sequence {seq_id} has {len(targets)} prompt targets for {tokens} positions"
            )
        if targets and (min(targets) < 0 or max(targets) >= vocab_size):
            raise ValueError(f"prompt targets must lie in 0..{vocab_size - 1}")


def _check_sequence(
    seq_id: int, tokens: int, start: int, table_len: int, limits: PlanLimits
) -> None:
    if tokens < 1:
        raise ValueError(f"sequence {seq_id} has {tokens} tokens; each needs at least one")
    if start < 0:
        raise ValueError(f"sequence {seq_id} starts at negative position {start}")
    end = start + tokens
    if end > limits.max_model_len:
        raise ValueError(
            f"sequence {seq_id} reaches {end} tokens, beyond max_model_len {limits.max_model_len}"
        )
    if table_len * limits.block_size < end:
        raise ValueError(
            f"sequence {seq_id} needs {math.ceil(end / limits.block_size)} blocks for {end} "
            f"tokens but its block table has {table_len}"
        )
