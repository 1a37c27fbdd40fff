"""Paged attention: the index tensors of one step, and the backends that compute it.

Each layer's cache (kv_cache.LayerKV) is a pair of tensors [kv_heads, num_blocks,
block_size, head_dim]; a sequence's token at absolute position p lives in slot
p % block_size of block block_table[p // block_size]. Heads come first so that gathering a
sequence's blocks yields, per head, one contiguous [tokens, head_dim] matrix: what the
matmuls want. The model has written the new tokens' K/V into their slots (with the rotary
embedding, layer_ops.rope_and_cache_) before a layer attends.

A step holds prefill chunks (sequences with several new tokens), attended one at a time,
and decode tokens (sequences with one new token), attended all together. Four backends
compute them (and HybridAttention mixes two); gpu_worker.kernels picks one per worker by
measuring the candidates:

- TorchAttention, PyTorch ops on any device, the reference. A chunk's queries go in blocks
  that only compute against the keys they can see (causal by absolute position), which
  halves a long chunk's work next to SDPA's CPU kernel, which computes the full square and
  masks it. Over long contexts, whose score matrices outgrow the cache, PyTorch's CPU
  flash-attention kernel takes over: once over the cached prefix, once causally over the
  chunk itself, the two merged by log-sum-exp. Decode tokens' keys are gathered into a
  buffer for one batched matmul, the softmax is masked by context length, and the values
  are never copied: embedding_bag sums the probability-weighted value rows straight from
  the cache.
- NativeAttention, the C++ kernels (gpu_worker.native): decode rows and prefill chunks each
  walk their block tables and read each K/V byte once. The chunk kernel needs bfloat16 on a
  CPU with AVX512-BF16.
- NativeRowsAttention, where the chunk kernel does not serve: the C++ decode kernel takes a
  chunk's rows too, one query each.
- FlexAttention, the CUDA backend: PyTorch's FlexAttention compiled through Triton, over
  the whole cache seen as one long key sequence. A block mask built from the block tables
  lists, for each query block, the cache blocks it reads (its sequence's, in order), so
  decode rows and prefill chunks read K/V in place, each byte once per query tile, and
  nothing is gathered: no temporary outside the KV budget. Blocks every query of a tile
  sees whole skip the mask; in the others a mask_mod maps a cache slot back to its position
  in the sequence. On a CPU FlexAttention runs eagerly, densely over every cache slot: a
  reference that tests the masks, not a kernel to serve with.

With the native backends a query row gets the same bits whatever else is in the step and
whether it is a decode row or a row of a prefill chunk, so recompute after a preemption
reproduces the tokens decoded before it, in bfloat16 too (`row_invariant`). PyTorch agrees
with them only to float tolerance.

An 8-bit cache (gpu_worker.kv_quant) carries a scale per row beside its codes. The C++
kernels dequantize a task's rows once and run their usual arithmetic; PyTorch gathers and
dequantizes the rows it needs (embedding_bag cannot read codes, so its decode multiplies
gathered values instead).

The index tensors are built once per step and shared by every layer, so the per-layer work
is a handful of kernels with no host synchronisation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from gpu_worker import native
from gpu_worker.kv_cache import LayerKV
from gpu_worker.kv_quant import KV_CACHE_DTYPES, as_bytes, dequantize

QUERY_BLOCK = 128  # prefill queries per attention block
# Past this many keys, a query block's score matrices (bfloat16 scores, float32 and
# bfloat16 probabilities for 128 queries of 9 heads: 19 MB at 2048 keys) outgrow the CPU's
# last-level cache and the blocked path slows down sharply; the flash kernel, which holds
# no score matrix, takes over (BENCHMARKS.md has the A/B). PyTorch has it for CPUs only.
FLASH_MIN_CONTEXT = 2048
# (output [B, heads, n, d], log-sum-exp [B, heads, n] in float32) of q, k, v [B, heads, n, d]
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class PrefillChunk:
    rows: slice  # the chunk's rows in the flattened batch
    start: int  # absolute position of the chunk's first token
    context_len: int  # start position + number of new tokens
    block_table: torch.Tensor  # [W] the sequence's blocks
    # TorchAttention's: rows of the cache seen as [kv_heads * blocks, ...] that hold the
    # context, head by head (None when the chunk starts at 0 and attends only to itself),
    # and a [QUERY_BLOCK, QUERY_BLOCK] tile, -inf above the diagonal.
    cache_rows: torch.Tensor | None = None
    causal_tile: torch.Tensor | None = None
    # NativeRowsAttention's: each row's block table [n, blocks] and context length [n].
    row_tables: torch.Tensor | None = None
    row_lens: torch.Tensor | None = None
    block_mask: BlockMask | None = None  # FlexAttention's


@dataclass(slots=True)
class DecodeGather:
    """TorchAttention's decode index tensors and key buffer."""

    key_rows: torch.Tensor  # [kv_heads * B * W] rows of the cache seen as [heads * blocks, ...]
    bias: torch.Tensor  # [kv_heads * B, 1, W * block_size]: 0 for a visible key, -inf past the end
    # [kv_heads * B * W, block_size * head_dim] gather buffer; None for an 8-bit cache,
    # whose keys are dequantized into a new tensor
    keys: torch.Tensor | None
    # One bag per (kv head, sequence, query head of the group): the flat value-cache rows
    # of the sequence's key slots, in the order of the softmax's columns.
    bag_rows: torch.Tensor  # [kv_heads * B * group * W * block_size]
    bag_offsets: torch.Tensor  # [kv_heads * B * group]


@dataclass(slots=True)
class DecodeGroup:
    rows: slice | torch.Tensor  # rows of the flattened batch that are single-token sequences
    block_tables: torch.Tensor  # [B, W]
    context_lens: torch.Tensor  # [B]
    gather: DecodeGather | None = None  # TorchAttention's only
    block_mask: BlockMask | None = None  # FlexAttention's


class AttentionBackend:
    """One way to compute paged attention; see the module docstring for the four.

    The defaults fit kernels that walk the block tables themselves and need no more."""

    name: str
    row_invariant: bool  # a row's bits depend on nothing but its query and context
    paged: bool = True  # reads K/V in place through the block tables, copying no context

    def decode_group(
        self,
        rows: slice | torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cache_like: torch.Tensor,
        group_size: int,
    ) -> DecodeGroup:
        """Tensor ops only, so that a CUDA graph can capture it with static inputs."""
        return DecodeGroup(rows, block_tables, context_lens)

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        """Adds what this backend needs to a chunk; `table` covers exactly its context."""
        return chunk

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        """q [B, heads, d] -> [B, heads, d]."""
        raise NotImplementedError

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        """One sequence's chunk: q [n, heads, d], its own k/v [n, kv_heads, d] -> [n, heads, d]."""
        raise NotImplementedError


@dataclass(slots=True)
class AttentionMetadata:
    slots: torch.Tensor  # [T] flat cache slot of each new token
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    num_tokens: int
    backend: AttentionBackend

    @property
    def decode_only(self) -> bool:
        return not self.prefills


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata
) -> torch.Tensor:
    """New tokens' q [T, heads, d] and k/v [T, kv_heads, d] -> attention output [T, heads * d].

    The new tokens' K/V must already be in their cache slots (layer_ops.rope_and_cache_).
    """
    num_tokens, backend, group = q.shape[0], meta.backend, meta.decode
    if group is not None and meta.decode_only:
        return backend.decode(q, kv, group).reshape(num_tokens, -1)
    out = q.new_empty(q.shape)
    for chunk in meta.prefills:
        rows = chunk.rows
        out[rows] = backend.prefill(q[rows], k[rows], v[rows], kv, chunk)
    if group is not None:
        out[group.rows] = backend.decode(q[group.rows], kv, group)
    return out.view(num_tokens, -1)


class TorchAttention(AttentionBackend):
    name = "torch"
    row_invariant = False
    paged = False

    def decode_group(
        self,
        rows: slice | torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cache_like: torch.Tensor,
        group_size: int,
    ) -> DecodeGroup:
        gather = _decode_gather(block_tables, context_lens, cache_like, group_size)
        return DecodeGroup(rows, block_tables, context_lens, gather)

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        kv_heads, cache_blocks = cache_like.shape[:2]
        # An 8-bit cache is read back for the chunk's own keys too: they must be the
        # values later steps will see.
        if chunk.start > 0 or cache_like.dtype in KV_CACHE_DTYPES.values():
            heads = torch.arange(kv_heads)[:, None] * cache_blocks
            rows = (heads + table).reshape(-1)
            chunk.cache_rows = rows.to(cache_like.device, non_blocking=True)
        chunk.causal_tile = causal_tile(_score_dtype(cache_like), cache_like.device)
        return chunk

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        return _gathered_decode_attention(q, kv, group.gather)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        if cpu_flash_serves(q.device, chunk, kv):
            return _flash_prefill_attention(q, k, v, kv, chunk)
        return _blocked_prefill_attention(q, k, v, kv, chunk)


def cpu_flash_serves(device: torch.device, chunk: PrefillChunk, kv: LayerKV) -> bool:
    """Whether PyTorch's CPU flash kernel takes a chunk: a long context, of a cache of the
    model's dtype, on a CPU (there is no such kernel for any other device)."""
    return chunk.context_len > FLASH_MIN_CONTEXT and device.type == "cpu" and not kv.quantized


class NativeAttention(AttentionBackend):
    name = "native"
    row_invariant = True

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    @staticmethod
    def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """bfloat16, on a CPU where the chunk kernel is registered (AVX512-BF16)."""
        kernels = native.kernels() if device.type == "cpu" else None
        return (
            dtype == torch.bfloat16
            and head_dim % 32 == 0
            and head_dim <= 256
            and hasattr(kernels, "paged_prefill_attention")
        )

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        return self._decode_rows(q, kv, group.block_tables, group.context_lens)

    def _decode_rows(
        self, q: torch.Tensor, kv: LayerKV, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """Query row i over the first lens[i] tokens of block table tables[i]."""
        scale = q.shape[-1] ** -0.5
        return self.kernels.paged_decode_attention(
            q, kv.k, kv.v, tables, lens, scale, kv.k_scales, kv.v_scales
        )

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        return self.kernels.paged_prefill_attention(
            q, kv.k, kv.v, chunk.block_table, chunk.start, scale, kv.k_scales, kv.v_scales
        )


class NativeRowsAttention(NativeAttention):
    name = "native-rows"

    @staticmethod
    def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Any dtype, on a CPU where the kernels build."""
        return device.type == "cpu" and native.kernels() is not None

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        count = chunk.context_len - chunk.start
        chunk.row_tables = table.expand(count, -1).contiguous()
        chunk.row_lens = torch.arange(chunk.start + 1, chunk.context_len + 1)
        return chunk

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        return self._decode_rows(q, kv, chunk.row_tables, chunk.row_lens)


class HybridAttention(NativeAttention):
    """The C++ decode kernel, PyTorch's prefill (oneDNN and flash attention, which use AMX
    tiles where a CPU has them). Not row invariant, so the chooser takes it only where no
    invariant candidate passes its check; it is measured and reported, and
    `--kernels attention=hybrid` pins it where long prompts' TTFT matters more than exact
    recompute."""

    name = "hybrid"
    row_invariant = False
    paged = False

    @staticmethod
    def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        return NativeRowsAttention.serves(device, dtype, head_dim)

    prefill_chunk = TorchAttention.prefill_chunk
    prefill = TorchAttention.prefill


class FlexAttention(AttentionBackend):
    """Paged attention through FlexAttention (see the module docstring); CUDA's backend."""

    name = "flex"
    row_invariant = False

    def decode_group(
        self,
        rows: slice | torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cache_like: torch.Tensor,
        group_size: int,
    ) -> DecodeGroup:
        block_size = cache_like.shape[2]
        lens = context_lens[:, None]
        mask = paged_block_mask(
            block_tables,
            context_lens - 1,
            (lens + block_size - 1) // block_size,
            lens // block_size,
            1,
            cache_like,
        )
        return DecodeGroup(rows, block_tables, context_lens, block_mask=mask)

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        device, block_size = cache_like.device, cache_like.shape[2]
        count = chunk.context_len - chunk.start
        # Query tile m holds the chunk's queries [m * QUERY_BLOCK, (m + 1) * QUERY_BLOCK).
        firsts = chunk.start + torch.arange(0, count, QUERY_BLOCK)
        lasts = torch.clamp(firsts + QUERY_BLOCK, max=chunk.context_len) - 1
        chunk.block_mask = paged_block_mask(
            table[None].to(device, non_blocking=True),
            torch.tensor([chunk.start], device=device),
            (lasts // block_size + 1)[None].to(device, non_blocking=True),
            ((firsts + 1) // block_size)[None].to(device, non_blocking=True),
            count,
            cache_like,
        )
        return chunk

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        return _flex(q[:, :, None], kv, group.block_mask)[:, :, 0]

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        """The chunk's own K/V are read back from the cache, where they already are."""
        return _flex(q.transpose(0, 1)[None], kv, chunk.block_mask)[0].transpose(0, 1)


def paged_block_mask(
    tables: torch.Tensor,
    q_first: torch.Tensor,
    counts: torch.Tensor,
    full: torch.Tensor,
    q_len: int,
    cache_like: torch.Tensor,
) -> BlockMask:
    """The block mask of `q_len` queries per sequence over the cache seen as one key sequence.

    tables [B, W]: each sequence's cache blocks; q_first [B]: the absolute position of its
    first query (query i sits at q_first + i and sees positions up to it); counts and full
    [B, tiles]: how many of its blocks query tile m sees at all, and how many whole (the
    first ones). Tensor ops only, so that a CUDA graph can capture it.

    The mask_mod finds a cache slot's position through the block's index in the tables:
    a block sits at one index in every table that holds it (its keys are rotated for those
    positions; a shared prefix block is shared at its place), the scratch block aside,
    which holds nothing anyone sees.
    """
    batch, width = tables.shape
    cache_blocks, block_size = cache_like.shape[1], cache_like.shape[2]
    columns = torch.arange(width, device=tables.device)
    index_of = torch.zeros(cache_blocks, dtype=torch.long, device=tables.device)
    index_of.scatter_(0, tables.reshape(-1), columns.repeat(batch))
    in_order = tables[:, None, :].expand(-1, counts.shape[1], -1)
    # A tile's partly visible blocks follow its whole ones in the table.
    partial = in_order.gather(2, (full[..., None] + columns).clamp(max=width - 1))

    def visible(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = kv_idx // block_size
        index = index_of[block]
        position = index * block_size + kv_idx % block_size
        return (tables[b, index] == block) & (position <= q_first[b] + q_idx)

    return BlockMask.from_kv_blocks(
        _per_tile(counts - full),
        _per_tile(partial),
        _per_tile(full),
        _per_tile(in_order),
        BLOCK_SIZE=(QUERY_BLOCK, block_size),
        mask_mod=visible,
        seq_lengths=(q_len, cache_blocks * block_size),
        compute_q_blocks=False,
    )


def _per_tile(t: torch.Tensor) -> torch.Tensor:
    """[B, tiles, ...] -> the [B, heads=1, tiles, ...] int32 layout of a BlockMask."""
    return t[:, None].to(torch.int32).contiguous()


def _flex(q: torch.Tensor, kv: LayerKV, mask: BlockMask) -> torch.Tensor:
    """q [B, heads, n, d] over the whole cache under `mask` -> [B, heads, n, d]."""
    if kv.quantized:
        raise RuntimeError("FlexAttention reads a cache of the model's dtype, not 8-bit codes")
    kv_heads, _, block_size, head_dim = kv.k.shape
    on_cuda = q.device.type == "cuda"
    if on_cuda and block_size % 16:
        raise RuntimeError("FlexAttention on CUDA needs a block size that is a multiple of 16")
    keys, values = (t.view(1, kv_heads, -1, head_dim) for t in (kv.k, kv.v))
    attend = _compiled_flex() if on_cuda else flex_attention
    return attend(
        q,
        keys,
        values,
        block_mask=mask,
        scale=head_dim**-0.5,
        enable_gqa=q.shape[1] != kv_heads,
        kernel_options=_kernel_options(mask) if on_cuda else None,
    )


@functools.cache
def _compiled_flex() -> Any:
    # Shapes vary by batch, table width and chunk length: dynamic after the first recompile.
    # Batch 1 and query length 1 are graphs of their own, as is each dtype and model shape
    # in one process (the smoke run's several models), and past dynamo's recompile limit
    # (8) it would run FlexAttention eagerly: densely over every slot of the cache.
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    return torch.compile(flex_attention, fullgraph=True)


def _kernel_options(mask: BlockMask) -> dict[str, int]:
    """A key tile must divide a cache block (Triton's tiles are 16 wide at least)."""
    return {"BLOCK_N": math.gcd(64, mask.BLOCK_SIZE[1])}


def _decode_gather(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
) -> DecodeGather:
    device = block_tables.device
    batch, width = block_tables.shape
    kv_heads, cache_blocks, block_size, head_dim = cache_like.shape
    keys_per_seq = width * block_size
    key_pos = torch.arange(keys_per_seq, device=device)
    visible = key_pos[None, :] < context_lens[:, None]
    bias = torch.zeros(visible.shape, dtype=_score_dtype(cache_like), device=device)
    bias.masked_fill_(~visible, -math.inf)
    slots = block_tables[:, :, None] * block_size + torch.arange(block_size, device=device)
    heads = torch.arange(kv_heads, device=device)
    key_rows = (heads[:, None] * cache_blocks + block_tables.reshape(1, -1)).reshape(-1)
    bag_rows = heads.view(-1, 1, 1, 1) * (cache_blocks * block_size) + slots.view(1, batch, 1, -1)
    bags = kv_heads * batch * group_size
    quantized = cache_like.dtype in KV_CACHE_DTYPES.values()
    return DecodeGather(
        key_rows=key_rows,
        bias=bias.repeat(kv_heads, 1).view(kv_heads * batch, 1, keys_per_seq),
        keys=None
        if quantized
        else cache_like.new_empty((kv_heads * batch * width, block_size * head_dim)),
        bag_rows=bag_rows.expand(kv_heads, batch, group_size, keys_per_seq).reshape(-1),
        bag_offsets=torch.arange(0, bags * keys_per_seq, keys_per_seq, device=device),
    )


def _blocked_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
) -> torch.Tensor:
    """As _prefill_attention, with matmuls over query blocks.

    Query block [i, e) sees keys [0, start + e): every key before start + i is visible to
    all its queries, so only the last e - i columns need the causal triangle.
    """
    num_queries, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group_size = heads // kv_heads
    if chunk.cache_rows is None:
        keys, values = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    else:
        keys = _gather(kv.k, kv.k_scales, chunk.cache_rows, chunk.context_len, q.dtype)
        values = _gather(kv.v, kv.v_scales, chunk.cache_rows, chunk.context_len, q.dtype)
    scale, unused = head_dim**-0.5, q.new_zeros(())  # beta=0: baddbmm ignores its input
    out = q.new_empty(q.shape)
    grouped = q.view(num_queries, kv_heads, group_size, head_dim)
    for first in range(0, num_queries, QUERY_BLOCK):
        end = min(first + QUERY_BLOCK, num_queries)
        size, visible = end - first, chunk.start + end
        # The query heads of one key/value head as that head's rows: [kv_heads, group * size, d].
        block = grouped[first:end].permute(1, 2, 0, 3).reshape(kv_heads, -1, head_dim)
        # As in decode: scaled inside the matmul, softmax in float32.
        scores = torch.baddbmm(
            unused, block, keys[:, :visible].transpose(1, 2), beta=0, alpha=scale
        )
        scores = scores.view(kv_heads, group_size, size, visible)
        scores[..., visible - size :].add_(chunk.causal_tile[:size, :size])
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = probs.view(kv_heads, -1, visible)
        block_out = torch.bmm(probs, values[:, :visible])
        by_query = block_out.view(kv_heads, group_size, size, head_dim).permute(2, 0, 1, 3)
        out[first:end] = by_query.reshape(size, heads, head_dim)
    return out


def _flash_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
) -> torch.Tensor:
    """As _blocked_prefill_attention, for long contexts.

    Two flash-attention passes, which never hold a score matrix: the queries over the
    cached prefix (every key visible, no mask) and over the chunk's own keys (plain causal,
    square), merged by their log-sum-exps.
    """
    num_queries, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group_size = heads // kv_heads
    scale = head_dim**-0.5
    # [1, heads, n, d]; the kernel needs one key/value head per query head.
    own_keys = k.transpose(0, 1).repeat_interleave(group_size, 0)[None]
    own_values = v.transpose(0, 1).repeat_interleave(group_size, 0)[None]
    out, lse = _FLASH(q.transpose(0, 1)[None], own_keys, own_values, is_causal=True, scale=scale)
    if chunk.cache_rows is not None:
        # Without a mask, the query heads of one key/value head are just more query rows.
        grouped = q.view(num_queries, kv_heads, group_size, head_dim).permute(1, 2, 0, 3)
        keys = _gather(kv.k, None, chunk.cache_rows, chunk.start, q.dtype)[None]
        values = _gather(kv.v, None, chunk.cache_rows, chunk.start, q.dtype)[None]
        queries = grouped.reshape(1, kv_heads, -1, head_dim)
        prefix_out, prefix_lse = _FLASH(queries, keys, values, scale=scale)
        out = _merge(
            prefix_out.view(1, heads, num_queries, head_dim),
            prefix_lse.reshape(1, heads, num_queries),
            out,
            lse,
        )
    return out[0].transpose(0, 1)


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint key sets -> attention over their union.

    Each part is weighted by its share of the softmax denominator, exp(lse_a) / (exp(lse_a)
    + exp(lse_b)) = sigmoid(lse_a - lse_b) for part a, computed in float32.
    """
    weight_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    merged = torch.lerp(out_b.float(), out_a.float(), weight_a)
    return merged.to(out_a.dtype)


def _gathered_decode_attention(q: torch.Tensor, kv: LayerKV, group: DecodeGather) -> torch.Tensor:
    """As _decode_attention, in PyTorch.

    The query heads that share a key/value head become that head's query rows, so grouped-
    query attention needs no copy of K per query head: (kv_heads * B) small matmuls of
    [group, d] x [d, keys]. An 8-bit cache's keys and values are gathered and dequantized
    (embedding_bag cannot read codes).
    """
    batch, heads, head_dim = q.shape
    kv_heads = kv.k.shape[0]
    group_size = heads // kv_heads
    if kv.quantized:
        keys = _rows_of(kv.k, kv.k_scales, group.key_rows, q.dtype)
    else:
        # Whole blocks of one head are contiguous rows of the cache seen as 2-D:
        # index_select copies those at memcpy speed (selecting along dim 1 of the 4-D
        # view does not).
        keys = torch.index_select(_as_rows(kv.k), 0, group.key_rows, out=group.keys)
    keys = keys.view(kv_heads * batch, -1, head_dim)
    queries = q.view(batch, kv_heads, group_size, head_dim).transpose(0, 1)
    # Scale and mask inside the matmul: the same values as scaling and masking a float32
    # copy of the scores afterwards, without those passes over them. The softmax still
    # computes in float32 (a bfloat16 softmax changes greedy tokens across schedules).
    scores = torch.baddbmm(
        group.bias.to(q.dtype),
        queries.reshape(kv_heads * batch, group_size, head_dim),
        keys.transpose(1, 2),
        alpha=head_dim**-0.5,
    )
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if kv.quantized:
        values = _rows_of(kv.v, kv.v_scales, group.key_rows, q.dtype).view(keys.shape)
        out = torch.bmm(probs, values)
    else:
        out = F.embedding_bag(
            group.bag_rows,
            kv.v.view(-1, head_dim),
            group.bag_offsets,
            mode="sum",
            per_sample_weights=probs.view(-1),
        )
    return (
        out.view(kv_heads, batch, group_size, head_dim)
        .transpose(0, 1)
        .reshape(batch, heads, head_dim)
    )


def _score_dtype(cache_like: torch.Tensor) -> torch.dtype:
    """The dtype of masks added to scores: the cache's, or float32 for an 8-bit cache
    (the model dtype is not known here; adding float32 to the scores rounds alike)."""
    return torch.float32 if cache_like.dtype in KV_CACHE_DTYPES.values() else cache_like.dtype


def _as_rows(cache: torch.Tensor) -> torch.Tensor:
    """[kv_heads, blocks, block_size, d] -> [kv_heads * blocks, block_size * d] (a view)."""
    return cache.view(cache.shape[0] * cache.shape[1], -1)


def _gather(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    rows: torch.Tensor,
    length: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One sequence's first `length` cached tokens -> [kv_heads, length, d] of `dtype`."""
    gathered = _rows_of(cache, scales, rows, dtype)
    return gathered.view(cache.shape[0], -1, cache.shape[3])[:, :length]


def _rows_of(
    cache: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Whole blocks `rows` of the cache seen as [kv_heads * blocks, block_size * d],
    dequantized to `dtype` when the cache is 8-bit."""
    gathered = _as_rows(as_bytes(cache)).index_select(0, rows).view(cache.dtype)
    if scales is None:
        return gathered
    block_size, head_dim = cache.shape[2], cache.shape[3]
    row_scales = scales.view(-1, block_size).index_select(0, rows)
    codes = gathered.view(-1, block_size, head_dim)
    return dequantize(codes, row_scales, dtype).view(gathered.shape)


def build_metadata(
    num_tokens: list[int],
    start_pos: list[int],
    block_tables: torch.Tensor,
    slots: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
    backend: AttentionBackend,
) -> AttentionMetadata:
    """Index tensors of one mixed step, shared by every layer.

    `block_tables` is the plan's tables padded to a common width ([S, W], on the host);
    `slots` the flat cache slot of each new token, already on the device; `cache_like`
    any layer's K cache; `group_size` the query heads per key/value head.
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
            chunk = PrefillChunk(slice(row, row + count), start, start + count, block_tables[seq])
            prefills.append(backend.prefill_chunk(chunk, table, cache_like))
        row += count
    decode = None
    if decode_seqs:
        decode = _decode_group_for(
            decode_seqs, decode_rows, start_pos, block_tables, cache_like, group_size, backend
        )
    return AttentionMetadata(slots, decode, prefills, row, backend)


def causal_tile(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tile = torch.full((QUERY_BLOCK, QUERY_BLOCK), -math.inf, dtype=dtype, device=device)
    return tile.triu_(diagonal=1)


def _decode_group_for(
    seqs: list[int],
    rows: list[int],
    start_pos: list[int],
    block_tables: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
    backend: AttentionBackend,
) -> DecodeGroup:
    device = cache_like.device
    block_size = cache_like.shape[2]
    context_lens = [start_pos[s] + 1 for s in seqs]
    width = -(-max(context_lens) // block_size)
    tables = block_tables[seqs, :width].to(device, non_blocking=True)
    lens = torch.tensor(context_lens, device=device)
    contiguous = rows[-1] - rows[0] == len(rows) - 1
    row_index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
    return backend.decode_group(row_index, tables, lens, cache_like, group_size)
