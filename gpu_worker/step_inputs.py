"""The spine of a step: every per-row fact of one StepPlan, derived once.

A plan lists rows (a sequence's part of the step); the model sees tokens. Which tokens
belong to which row, their absolute positions, their cache slots, each row's block tables
in each KV group (gpu_worker.kv_groups: one for most models) gathered from the worker's
SeqTable, each row's SamplingSpec, which rows sample and from which token, which rows are
single-token (decode) rows, each row's context: every part of the worker (attention
metadata, the eager and the graph-replayed forward, the sampler) reads these facts from a
StepInputs and derives none of them itself.

The host sends the device one packed copy of the positions and table slots per step; the
tables never leave the device. A decode-only step is padded to a batch bucket and a table
width (gpu_worker.graphs): `decode_tensors` pads the step's own tensors, and
`padding_tensors` makes a step of padding alone (graph capture), by one rule: padding
rows write and read only the scratch block, with context length 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.protocol import POOL_LAST, POOL_SUM, SamplingSpec, StepPlan
from gpu_worker.seq_table import PlanLimits, Seq, SeqTable

__all__ = ["PlanLimits", "StepInputs", "padded_rows", "padding_tensors"]


@dataclass(slots=True)
class StepInputs:
    plan: StepPlan
    seqs: list[Seq]  # each row's sequence, as the worker holds it
    block_size: int
    scratch_block: int
    first_rows: torch.Tensor  # [S] each row's first token in the flattened batch (host)
    positions: torch.Tensor  # [T] each token's absolute position (host)
    tables: torch.Tensor  # [G, S, W] each row's block tables, padded with the scratch block
    slots: torch.Tensor  # [G, T] the cache slot each token's K/V is written to, per group
    sampled: list[int]  # the rows that sample, in plan order
    # what each row pools (embeddings): every row of a POOL_SUM sequence, the row that ends
    # a POOL_LAST sequence's prompt; None for the others ([] when no row pools)
    pooling: list[str | None]

    @classmethod
    def of(cls, plan: StepPlan, table: SeqTable) -> StepInputs:
        """The facts of a plan that `table` has applied (SeqTable.apply checked it)."""
        limits = table.limits
        bs = limits.block_size
        seqs = [table.seq(row.seq_id) for row in plan.rows]
        counts = torch.tensor(plan.num_tokens, dtype=torch.long)
        first_rows = torch.cumsum(counts, 0) - counts
        row_of_token = torch.repeat_interleave(torch.arange(len(counts)), counts)
        offsets = torch.arange(plan.total_tokens) - first_rows[row_of_token]
        positions = torch.tensor(plan.start_pos, dtype=torch.long)[row_of_token] + offsets
        width = max((seq.num_blocks for seq in seqs), default=1)
        # one copy to the device: the rows' table slots, then each token's row and position
        slot_ids = torch.tensor([seq.slot for seq in seqs], dtype=torch.long)
        packed = torch.cat([slot_ids, row_of_token, positions]).to(table.device, non_blocking=True)
        on_device_slots, on_device_rows, on_device_positions = packed.split(
            [len(seqs), len(row_of_token), len(positions)]
        )
        tables = table.tables[:, on_device_slots, :width]
        blocks = tables[:, on_device_rows, on_device_positions // bs]
        slots = blocks * bs + on_device_positions % bs
        sampled = [i for i, row in enumerate(plan.rows) if row.sample]
        pooling = _pooling(plan, seqs)
        return cls(
            plan,
            seqs,
            bs,
            limits.scratch_block,
            first_rows,
            positions,
            tables,
            slots,
            sampled,
            pooling,
        )

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

    def decode_tensors(
        self, batch: int, width: int, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """A decode-only step's (input_ids, positions, slots [G, B], tables [G, B, W],
        context_lens) for `batch` rows and tables `width` wide (graphs.decode_forward's
        inputs)."""
        rows = self.num_seqs
        host = torch.stack([torch.tensor(self.plan.input_ids, dtype=torch.long), self.positions])
        input_ids, positions = host.to(device, non_blocking=True)
        tables = self.tables[:, :rows, :width]
        return _padded(
            input_ids,
            positions,
            self.slots,
            tables,
            self.block_size,
            self.scratch_block,
            batch,
            width,
        )


def _pooling(plan: StepPlan, seqs: list[Seq]) -> list[str | None]:
    if all(seq.pooling is None for seq in seqs):
        return []
    kinds: list[str | None] = []
    for row, seq in zip(plan.rows, seqs, strict=True):
        ends_prompt = row.start_pos + row.num_tokens >= seq.prompt_len
        pools = seq.pooling == POOL_SUM or (seq.pooling == POOL_LAST and ends_prompt)
        kinds.append(seq.pooling if pools else None)
    return kinds


def padding_tensors(
    block_size: int,
    scratch_block: int,
    batch: int,
    width: int,
    device: torch.device,
    num_groups: int = 1,
) -> tuple[torch.Tensor, ...]:
    """decode_tensors of a step with no row: `batch` padding rows (graph capture)."""
    nothing = torch.zeros(0, dtype=torch.long, device=device)
    return _padded(
        nothing,
        nothing,
        nothing.view(1, 0).expand(num_groups, 0),
        nothing.view(1, 0, 0).expand(num_groups, 0, 0),
        block_size,
        scratch_block,
        batch,
        width,
    )


def padded_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: int,
    block_size: int,
    scratch: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one padding rule: rows beyond the step's own are token 0 at position 0, and
    write their K/V to the scratch block (slots [G, T]). Decode graphs and the mixed
    steps' pieces (gpu_worker.piecewise) pad by it."""
    pad = rows - input_ids.shape[0]
    return (
        F.pad(input_ids, (0, pad)),
        F.pad(positions, (0, pad)),
        F.pad(slots, (0, pad), value=scratch * block_size),
    )


def _padded(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    scratch: int,
    batch: int,
    width: int,
) -> tuple[torch.Tensor, ...]:
    """padded_rows, and a decode step's tables and contexts: table entries beyond a row's
    own, and a padding row's, name the scratch block; a padding row's context is 1."""
    pad = batch - input_ids.shape[0]
    return (
        *padded_rows(input_ids, positions, slots, batch, block_size, scratch),
        F.pad(tables, (0, width - tables.shape[2], 0, pad), value=scratch),
        F.pad(positions + 1, (0, pad), value=1),
    )
