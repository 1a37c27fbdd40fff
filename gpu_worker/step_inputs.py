"""The spine of a step: every per-row fact of one StepPlan, derived once.

A plan lists rows (a sequence's part of the step); the model sees tokens. Which tokens
belong to which row, their absolute positions, their cache slots, each row's block tables
in each KV group (gpu_worker.kv_groups: one for most models) gathered from the worker's
SeqTable, each row's SamplingSpec, which rows sample and from which token, which rows are
single-token (decode) rows, each row's context: every part of the worker (attention
metadata, the eager and the graph-replayed forward, the sampler) reads these facts from a
StepInputs and derives none of them itself.

The host facts are built with numpy. The tables never leave the device: a step's rows'
tables and its tokens' slots are gathered there from one packed copy, at their first use,
so a decode-only step that a graph replays, which stages its own integers
(gpu_worker.staging), never builds them. One padding rule holds for decode graphs and the
mixed steps' graphs alike: padding rows are token 0 at position 0 and write and read only
the scratch block, with context length 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.protocol import POOL_LAST, POOL_SUM, SamplingSpec, StepPlan
from gpu_worker.seq_table import PlanLimits, Seq, SeqTable

__all__ = ["PlanLimits", "StepInputs", "padded_rows"]


@dataclass(slots=True)
class StepInputs:
    plan: StepPlan
    seqs: list[Seq]  # each row's sequence, as the worker holds it
    block_size: int
    scratch_block: int
    held_tables: torch.Tensor  # [G, slots, W] the worker's tables (SeqTable.tables)
    first_rows: torch.Tensor  # [S] each row's first token in the flattened batch (host)
    row_of_token: torch.Tensor  # [T] the row each token belongs to (host)
    positions: torch.Tensor  # [T] each token's absolute position (host)
    sampled: list[int]  # the rows that sample, in plan order
    # what each row pools (embeddings): every row of a POOL_SUM sequence, the row that ends
    # a POOL_LAST sequence's prompt; None for the others ([] when no row pools)
    pooling: list[str | None]
    # [T] each token's LoRA slot (host; -1: the base model); None where no row is adapted
    adapter_of_token: torch.Tensor | None = None
    _on_device: tuple[torch.Tensor, torch.Tensor] | None = None  # (tables, slots) once built

    @classmethod
    def of(cls, plan: StepPlan, table: SeqTable) -> StepInputs:
        """The facts of a plan that `table` has applied (SeqTable.apply checked it)."""
        limits = table.limits
        seqs = [table.seq(row.seq_id) for row in plan.rows]
        counts = np.array(plan.num_tokens, dtype=np.int64)
        first_rows = np.cumsum(counts) - counts
        row_of_token = np.repeat(np.arange(len(counts)), counts)
        offsets = np.arange(plan.total_tokens) - first_rows[row_of_token]
        positions = np.array(plan.start_pos, dtype=np.int64)[row_of_token] + offsets
        return cls(
            plan,
            seqs,
            limits.block_size,
            limits.scratch_block,
            table.tables,
            torch.from_numpy(first_rows),
            torch.from_numpy(row_of_token),
            torch.from_numpy(positions),
            [i for i, row in enumerate(plan.rows) if row.sample],
            _pooling(plan, seqs),
            _adapter_of_token(seqs, row_of_token),
        )

    @property
    def tables(self) -> torch.Tensor:
        """[G, S, W] each row's block tables on the device, W the widest row's, padded with
        the scratch block. Built at first use: a decode step replayed from a graph gathers
        its own (gpu_worker.staging), so it never builds these."""
        return self._device_facts()[0]

    @property
    def slots(self) -> torch.Tensor:
        """[G, T] the cache slot each token's K/V is written to, per group, on the device."""
        return self._device_facts()[1]

    def _device_facts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._on_device is None:
            held, bs = self.held_tables, self.block_size
            width = max((seq.num_blocks for seq in self.seqs), default=1)
            # one copy to the device: the rows' table slots, then each token's row and position
            slot_ids = torch.tensor([seq.slot for seq in self.seqs], dtype=torch.long)
            packed = torch.cat([slot_ids, self.row_of_token, self.positions])
            rows, tokens, positions = packed.to(held.device, non_blocking=True).split(
                [len(slot_ids), len(self.row_of_token), len(self.positions)]
            )
            tables = held[:, rows, :width]
            slots = tables[:, tokens, positions // bs] * bs + positions % bs
            self._on_device = (tables, slots)
        return self._on_device

    @property
    def num_seqs(self) -> int:
        return len(self.plan.rows)

    @property
    def decode_only(self) -> bool:
        """Every row adds one token: the step graphs.DecodeRunner pads and replays."""
        return all(row.num_tokens == 1 for row in self.plan.rows)

    def is_decode(self, row: int) -> bool:
        """The one definition of a decode row: a single new token."""
        return self.plan.rows[row].num_tokens == 1

    def ends(self, rows: list[int]) -> list[int]:
        """Each row's sequence length after this step (the position its next token takes)."""
        plan = self.plan
        return [plan.rows[i].start_pos + plan.rows[i].num_tokens for i in rows]

    def last_rows(self, rows: list[int]) -> torch.Tensor:
        """The token of each row's last position (the one that samples)."""
        counts = torch.tensor(self.plan.num_tokens, dtype=torch.long)
        return (self.first_rows + counts - 1)[rows]

    def sampling(self) -> list[SamplingSpec]:
        """The sampled rows' settings, in plan order."""
        return [self.seqs[i].sampling for i in self.sampled]


def _adapter_of_token(seqs: list[Seq], row_of_token: np.ndarray) -> torch.Tensor | None:
    slots = np.array([seq.adapter_slot for seq in seqs], dtype=np.int64)
    if not (slots >= 0).any():
        return None
    return torch.from_numpy(slots[row_of_token])


def _pooling(plan: StepPlan, seqs: list[Seq]) -> list[str | None]:
    if all(seq.pooling is None for seq in seqs):
        return []
    kinds: list[str | None] = []
    for row, seq in zip(plan.rows, seqs, strict=True):
        ends_prompt = row.start_pos + row.num_tokens >= seq.prompt_len
        pools = seq.pooling == POOL_SUM or (seq.pooling == POOL_LAST and ends_prompt)
        kinds.append(seq.pooling if pools else None)
    return kinds


def padded_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: int,
    block_size: int,
    scratch: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one padding rule: rows beyond the step's own are token 0 at position 0, and
    write their K/V to the scratch block (slots [G, T]): the mixed steps' graphs
    (gpu_worker.mixed_graphs) pad by it; decode graphs by the same rule, staged
    (gpu_worker.staging)."""
    pad = rows - input_ids.shape[0]
    return (
        F.pad(input_ids, (0, pad)),
        F.pad(positions, (0, pad)),
        F.pad(slots, (0, pad), value=scratch * block_size),
    )
