"""What every attention backend shares: a step's index records, the backend interface,
and the one function the model calls per layer.

A step holds prefill chunks (sequences with several new tokens), attended one at a time
or, by a backend that can, all in one launch (`prefill_step`, `prefill_all`), and decode
tokens (sequences with one new token), attended all together. `build_metadata` makes one
record per chunk and one for the decode rows, once per step; each backend adds what it
alone needs to them (`prepared`: its own record, which no other backend reads).
The index tensors are built once per step and shared by every layer, so the per-layer work
is a handful of kernels with no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.kv_cache import LayerKV
from gpu_worker.step_inputs import StepInputs

QUERY_BLOCK = 128  # prefill queries per attention block


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How a layer attends, where layers differ: its scale, its sliding window (a query at
    position p sees keys at positions p - window < k <= p), Gemma 2's soft-capping of
    the scores (cap * tanh(score / cap), before the mask) and whether it has attention
    sinks (gpt-oss: a logit per head that joins each softmax's denominator and takes no
    value; the values are the layer's own, passed to paged_attention). A step's records
    are built once per distinct kind (a Llama model has one), and every layer of that kind
    shares them."""

    scale: float | None = None  # None: head_dim ** -0.5
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def scale_for(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else self.scale


FULL = LayerAttention()


@dataclass(slots=True)
class PrefillChunk:
    rows: slice  # the chunk's rows in the flattened batch
    start: int  # absolute position of the chunk's first token
    context_len: int  # start position + number of new tokens
    block_table: torch.Tensor  # [W] the sequence's blocks
    prepared: Any = None  # the backend's own record (AttentionBackend.prefill_chunk)
    layer: LayerAttention = FULL


@dataclass(slots=True)
class DecodeGroup:
    rows: slice | torch.Tensor  # rows of the flattened batch that are single-token sequences
    block_tables: torch.Tensor  # [B, W]
    context_lens: torch.Tensor  # [B]
    prepared: Any = None  # the backend's own record (AttentionBackend.decode_group)
    layer: LayerAttention = FULL


class AttentionBackend:
    """One way to compute paged attention; gpu_worker.attention lists them.

    The defaults fit kernels that walk the block tables themselves and need no more."""

    name: str
    row_invariant: bool  # a row's bits depend on nothing but its query and context
    paged: bool = True  # reads K/V in place through the block tables, copying no context
    windows: bool = False  # serves sliding windows (LayerAttention.window)
    softcap: bool = False  # serves soft-capped scores (LayerAttention.softcap)
    # serves attention sinks (LayerAttention.sinks): attend_sinks, decode_sinks, prefill_sinks
    sinks: bool = False
    # its cost does not grow with the block tables' width, only with the contexts: decode
    # steps pad every table to the longest (gpu_worker.graphs)
    any_width: bool = False
    # attends a whole mixed step from static records (`attend_captured`), so that a graph
    # captures the step whole (gpu_worker.mixed_graphs)
    captures_steps: bool = False

    def compiles(self, device: torch.device) -> bool:
        """Whether it compiles per shape on `device`: the worker warms it up then
        (gpu_worker.warm_up)."""
        return False

    def serves_layers(self, layers: list[LayerAttention]) -> bool:
        """Whether it computes every one of a model's kinds of attention layer."""
        return all(
            (self.windows or layer.window is None)
            and (self.softcap or layer.softcap is None)
            and (self.sinks or not layer.sinks)
            for layer in layers
        )

    def decode_group(
        self, group: DecodeGroup, cache_like: torch.Tensor, group_size: int
    ) -> DecodeGroup:
        """Adds what this backend needs to the decode rows' record; tensor ops only, so
        that a CUDA graph can capture it with static inputs."""
        return group

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        """Adds what this backend needs to a chunk; `table` covers exactly its context."""
        return chunk

    def prefill_step(self, chunks: list[PrefillChunk], cache_like: torch.Tensor) -> Any:
        """What this backend needs to attend all of a step's chunks at once (`prefill_all`),
        after `prefill_chunk` has seen each; None by default."""
        return None

    def prefill_all(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Every chunk of the step, rows of q [T, heads, d] and k/v [T, kv_heads, d] -> its
        rows of out [T, heads, d]; by default one `prefill` each."""
        for chunk in meta.prefills:
            rows = chunk.rows
            out[rows] = self.prefill(q[rows], k[rows], v[rows], kv, chunk)

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        """q [B, heads, d] -> [B, heads, d]."""
        raise NotImplementedError

    def chunk_slots(
        self, cu_q: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor
    ) -> Any:
        """The record `attend_captured` reads for a step's chunks, over static buffers: the
        cumulative counts of their queries, their first rows, positions and tables, with
        slots past the step's chunks empty (no queries). Backends that capture steps."""
        raise NotImplementedError

    def attend_captured(
        self, q: torch.Tensor, kv: LayerKV, step: CapturedStep, out: torch.Tensor
    ) -> None:
        """A whole mixed step from static records: q [T, heads, d] -> out [T + 1, heads, d],
        whose last row takes the padding decode slots' output. Backends that capture steps."""
        raise NotImplementedError

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        """One sequence's chunk: q [n, heads, d], its own k/v [n, kv_heads, d] -> [n, heads, d]."""
        raise NotImplementedError

    def attend_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        """paged_attention's rows [T, heads, d] of a layer with attention sinks [heads]:
        by default each chunk's `prefill_sinks` and the decode rows' `decode_sinks`.
        Backends that serve sinks; never captured (such a model runs eagerly)."""
        out = q.new_empty(q.shape)
        for chunk in meta.prefills:
            rows = chunk.rows
            out[rows] = self.prefill_sinks(q[rows], k[rows], v[rows], kv, chunk, sinks)
        group = meta.decode
        if group is not None:
            out[group.rows] = self.decode_sinks(q[group.rows], kv, group, sinks)
        return out

    def decode_sinks(
        self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup, sinks: torch.Tensor
    ) -> torch.Tensor:
        """As `decode`, each row's softmax with its head's sink [heads]. Backends that
        serve sinks."""
        raise NotImplementedError

    def prefill_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        chunk: PrefillChunk,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        """As `prefill`, each row's softmax with its head's sink [heads]. Backends that
        serve sinks."""
        raise NotImplementedError


@dataclass(slots=True)
class CapturedStep:
    """A mixed step's records where every tensor is a static buffer, refilled each step, so
    that one CUDA graph captures the step whole (gpu_worker.mixed_graphs): a fixed count of
    chunk slots and of decode slots, those past the step's own empty. A padding decode slot
    attends the scratch block (context 1) from q's first row and lands in out's extra row."""

    chunks: Any  # the backend's record of the chunk slots (chunk_slots)
    decode: DecodeGroup  # the decode slots: rows are `gather`
    gather: torch.Tensor  # [B] each decode slot's row in q
    scatter: torch.Tensor  # [B] its row in out: the same, or T for a padding slot


@dataclass(slots=True)
class AttentionMetadata:
    slots: torch.Tensor  # [T] flat cache slot of each new token
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    num_tokens: int
    backend: AttentionBackend
    prepared: Any = None  # the backend's record of all the chunks (prefill_step)
    captured: CapturedStep | None = None  # the step's records as static buffers, instead

    @property
    def decode_only(self) -> bool:
        return not self.prefills and self.captured is None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerKV,
    meta: AttentionMetadata,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens' q [T, heads, d] and k/v [T, kv_heads, d] -> attention output [T, heads * d];
    `sinks` [heads]: the layer's attention sinks, where its kind has them.

    The new tokens' K/V must already be in their cache slots (layer_ops.rope_and_cache_).
    """
    num_tokens, backend, group = q.shape[0], meta.backend, meta.decode
    if sinks is not None:
        return backend.attend_sinks(q, k, v, kv, meta, sinks).view(num_tokens, -1)
    if meta.captured is not None:
        # zeros: a padding token's row is no chunk's or decode row's, and its output goes on
        # to write the scratch block's K/V, which padding decode slots read
        out = q.new_zeros((num_tokens + 1, *q.shape[1:]))
        backend.attend_captured(q, kv, meta.captured, out)
        return out[:num_tokens].view(num_tokens, -1)
    if group is not None and meta.decode_only:
        return backend.decode(q, kv, group).reshape(num_tokens, -1)
    out = q.new_empty(q.shape)
    if meta.prefills:
        backend.prefill_all(q, k, v, kv, meta, out)
    if group is not None:
        out[group.rows] = backend.decode(q[group.rows], kv, group)
    return out.view(num_tokens, -1)


def build_metadata(
    inputs: StepInputs,
    group: int,
    cache_like: torch.Tensor,
    group_size: int,
    backend: AttentionBackend,
    layer: LayerAttention = FULL,
) -> AttentionMetadata:
    """A step's records in KV group `group`, from its facts (metadata_for)."""
    plan = inputs.plan
    return metadata_for(
        plan.num_tokens,
        plan.start_pos,
        inputs.tables[group],
        inputs.slots[group],
        cache_like,
        group_size,
        backend,
        layer,
    )


def metadata_for(
    num_tokens: list[int],
    start_pos: list[int],
    block_tables: torch.Tensor,
    slots: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
    backend: AttentionBackend,
    layer: LayerAttention = FULL,
) -> AttentionMetadata:
    """Index tensors of one mixed step, shared by every layer of kind `layer`, from its
    rows' token counts and start positions (a decode row is one of a single token).

    `block_tables` is the rows' tables padded to a common width ([S, W]); `slots` the
    flat cache slot of each new token, on the device; `cache_like` any layer's K cache;
    `group_size` the query heads per key/value head.
    """
    prefills: list[PrefillChunk] = []
    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    block_size = cache_like.shape[2]
    row = 0
    for seq, (count, start) in enumerate(zip(num_tokens, start_pos, strict=True)):
        if count == 1:
            decode_seqs.append(seq)
            decode_rows.append(row)
        else:
            table = block_tables[seq, : -(-(start + count) // block_size)]
            chunk = PrefillChunk(
                slice(row, row + count), start, start + count, block_tables[seq], layer=layer
            )
            prefills.append(backend.prefill_chunk(chunk, table, cache_like))
        row += count
    decode = None
    if decode_seqs:
        decode = _decode_group_for(
            decode_seqs,
            decode_rows,
            start_pos,
            block_tables,
            cache_like,
            group_size,
            backend,
            layer,
        )
    prepared = backend.prefill_step(prefills, cache_like) if prefills else None
    return AttentionMetadata(slots, decode, prefills, row, backend, prepared)


def _decode_group_for(
    seqs: list[int],
    rows: list[int],
    start_pos: list[int],
    block_tables: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
    backend: AttentionBackend,
    layer: LayerAttention,
) -> DecodeGroup:
    device = cache_like.device
    block_size = cache_like.shape[2]
    context_lens = [start_pos[s] + 1 for s in seqs]
    width = -(-max(context_lens) // block_size)
    tables = block_tables[seqs, :width].to(device, non_blocking=True)
    lens = torch.tensor(context_lens, device=device)
    contiguous = rows[-1] - rows[0] == len(rows) - 1
    row_index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
    return decode_records(row_index, tables, lens, cache_like, group_size, backend, layer)


def decode_records(
    rows: slice | torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
    backend: AttentionBackend,
    layer: LayerAttention,
) -> DecodeGroup:
    """The decode rows' record, with what `backend` adds to it: the one builder of it, for
    a mixed step's decode rows and a decode step's padded batch (graphs.decode_forward)."""
    group = DecodeGroup(rows, tables, context_lens, layer=layer)
    return backend.decode_group(group, cache_like, group_size)
