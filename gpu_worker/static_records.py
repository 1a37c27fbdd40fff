"""A mixed step's attention records as static buffers: what a graph that captures the step
whole (gpu_worker.mixed_graphs) reads, refilled before each replay.

A step of up to T tokens (its token bucket) has at most T // 2 prompt chunks (a chunk is
two tokens or more: a single new token is a decode row) and at most T decode rows, and
never more rows than the worker's max_num_seqs: a bucket's records hold that many chunk
slots and decode slots, and the slots past the step's own are padding. A padding chunk
slot has no queries (its entry of the cumulative counts repeats the total), so the
kernel's programs for it return at once. A padding decode slot attends the scratch block
at context 1 (the tables' PAD_SLOT row) from q's first row, and its output lands in a row
past the step's (CapturedStep).

Every integer goes in one [RECORDS, n] host buffer, pinned on CUDA, and one copy; each
KV group's tables are then gathered from the worker's own (SeqTable: they never leave the
device) into the static ones, one gather for the chunks and one for the decode rows. The
tables are as wide as the worker's, so a row's decode attention is split as for any width
(the decode kernel counts a row's segments from its context alone: the same bits). Every
bucket's buffers are the first entries of the largest's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention import AttentionMetadata, LayerAttention, decode_records
from gpu_worker.attention.base import AttentionBackend, CapturedStep
from gpu_worker.seq_table import PAD_SLOT
from gpu_worker.step_inputs import StepInputs

# The rows of the integer buffer.
CU_Q, CHUNK_ROWS, CHUNK_STARTS, CHUNK_SEQS, GATHER, SCATTER, CONTEXTS, DECODE_SEQS = range(8)
RECORDS = 8


def slot_counts(tokens: int, max_num_seqs: int) -> tuple[int, int]:
    """(chunk slots, decode slots) of a step of at most `tokens` tokens."""
    return max(1, min(tokens // 2, max_num_seqs)), min(tokens, max_num_seqs)


@dataclass(slots=True)
class _Bucket:
    tokens: int
    chunks: int
    decodes: int


class StaticRecords:
    """The records of every token bucket, views of one set of buffers; `metadata` builds a
    bucket's records over them once (at capture), `fill` writes a step into them."""

    def __init__(
        self,
        backend: AttentionBackend,
        kinds: list[LayerAttention],
        held_width: int,
        largest: int,
        max_num_seqs: int,
        cache_like: torch.Tensor,
        group_size: int,
        scratch_block: int,
    ) -> None:
        self.backend = backend
        self.scratch_block = scratch_block
        self.kinds = kinds  # each KV group's kind of layer
        self.max_num_seqs = max_num_seqs
        self.cache_like = cache_like
        self.group_size = group_size
        device = cache_like.device
        chunks, decodes = slot_counts(largest, max_num_seqs)
        width = -(-max(chunks + 1, decodes) // 2) * 2  # each row 16-byte aligned
        self.ints = torch.zeros((RECORDS, width), dtype=torch.long, device=device)
        self._host = torch.zeros(
            (RECORDS, width), dtype=torch.long, pin_memory=device.type == "cuda"
        )
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        self.chunk_tables = [
            torch.zeros((chunks, held_width), dtype=torch.long, device=device) for _ in kinds
        ]
        self.decode_tables = [
            torch.zeros((decodes, held_width), dtype=torch.long, device=device) for _ in kinds
        ]

    def bucket(self, tokens: int) -> _Bucket:
        return _Bucket(tokens, *slot_counts(tokens, self.max_num_seqs))

    def metadata(self, tokens: int, slots: torch.Tensor) -> list[AttentionMetadata]:
        """Each KV group's records of a step in bucket `tokens`, over the static buffers;
        `slots` [G, tokens] the static cache slots of its tokens."""
        bucket, ints, backend = self.bucket(tokens), self.ints, self.backend
        c, d = bucket.chunks, bucket.decodes
        metas = []
        for g, kind in enumerate(self.kinds):
            chunks = backend.chunk_slots(
                ints[CU_Q, : c + 1],
                ints[CHUNK_ROWS, :c],
                ints[CHUNK_STARTS, :c],
                self.chunk_tables[g][:c],
            )
            gather = ints[GATHER, :d]
            decode = decode_records(
                gather,
                self.decode_tables[g][:d],
                ints[CONTEXTS, :d],
                self.cache_like,
                self.group_size,
                backend,
                kind,
            )
            captured = CapturedStep(chunks, decode, gather, ints[SCATTER, :d])
            metas.append(AttentionMetadata(slots[g], None, [], tokens, backend, None, captured))
        return metas

    def fill(self, inputs: StepInputs, tokens: int) -> None:
        """Writes the step (at most `tokens` tokens) into the bucket's records."""
        self.write(StepRows.of(inputs), tokens, inputs.held_tables)

    def write(self, rows: StepRows, tokens: int, held: torch.Tensor) -> None:
        """Writes `rows` into bucket `tokens`' records, their tables gathered from the
        worker's `held` [G, table rows, W]."""
        bucket = self.bucket(tokens)
        self._send_ints(rows, bucket)
        self._gather_tables(bucket, held)

    def pad(self, tokens: int) -> None:
        """Writes a step of no rows into the bucket's records, its tables the scratch
        block's alone (capture: the warm-up runs touch nothing else)."""
        self._send_ints(StepRows.none(), self.bucket(tokens))
        for table in (*self.chunk_tables, *self.decode_tables):
            table.fill_(self.scratch_block)

    def _send_ints(self, rows: StepRows, bucket: _Bucket) -> None:
        if self._sent is not None:  # the last step's copy has left the host buffer
            self._sent.synchronize()
        host = self._host[:, : max(bucket.chunks + 1, bucket.decodes)]
        rows.write(host.numpy(), bucket)
        self.ints[:, : host.shape[1]].copy_(host, non_blocking=True)
        if self._sent is not None:
            self._sent.record()

    def _gather_tables(self, bucket: _Bucket, held: torch.Tensor) -> None:
        """Each KV group's tables of the slots' rows, from the worker's `held` [G, rows, W]."""
        for g in range(len(self.kinds)):
            chunk_out = self.chunk_tables[g][: bucket.chunks]
            decode_out = self.decode_tables[g][: bucket.decodes]
            torch.index_select(held[g], 0, self.ints[CHUNK_SEQS, : bucket.chunks], out=chunk_out)
            torch.index_select(held[g], 0, self.ints[DECODE_SEQS, : bucket.decodes], out=decode_out)


@dataclass(slots=True)
class StepRows:
    """A step's rows, on the host: each one's new tokens, first row in the step, start
    position and row of the worker's tables."""

    counts: np.ndarray
    first_rows: np.ndarray
    starts: np.ndarray
    seq_slots: np.ndarray

    @classmethod
    def of(cls, inputs: StepInputs) -> StepRows:
        plan = inputs.plan
        return cls(
            np.asarray(plan.num_tokens, dtype=np.int64),
            inputs.first_rows.numpy(),
            np.asarray(plan.start_pos, dtype=np.int64),
            np.asarray([seq.slot for seq in inputs.seqs], dtype=np.int64),
        )

    @classmethod
    def none(cls) -> StepRows:
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, empty, empty)

    def write(self, values: np.ndarray, bucket: _Bucket) -> None:
        """The chunks and decode rows into `values` [RECORDS, n], padding after them."""
        is_chunk = self.counts > 1
        chunk, decode = np.flatnonzero(is_chunk), np.flatnonzero(~is_chunk)
        n, m = len(chunk), len(decode)
        if n > bucket.chunks or m > bucket.decodes:
            raise ValueError(f"{n} chunks and {m} decode rows do not fit {bucket}")
        values[CU_Q, 0] = 0
        values[CU_Q, 1 : n + 1] = np.cumsum(self.counts[chunk])
        values[CU_Q, n + 1 :] = values[CU_Q, n]
        values[CHUNK_ROWS, :n] = self.first_rows[chunk]
        values[CHUNK_STARTS, :n] = self.starts[chunk]
        values[CHUNK_SEQS, :n] = self.seq_slots[chunk]
        values[[CHUNK_ROWS, CHUNK_STARTS], n:] = 0
        values[CHUNK_SEQS, n:] = PAD_SLOT
        values[GATHER, :m] = self.first_rows[decode]
        values[SCATTER, :m] = self.first_rows[decode]
        values[CONTEXTS, :m] = self.starts[decode] + 1
        values[DECODE_SEQS, :m] = self.seq_slots[decode]
        values[GATHER, m:] = 0
        values[SCATTER, m:] = bucket.tokens
        values[CONTEXTS, m:] = 1
        values[DECODE_SEQS, m:] = PAD_SLOT
