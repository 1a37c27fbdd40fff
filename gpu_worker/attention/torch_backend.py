"""TorchAttention: PyTorch ops on any device, the reference every backend is checked against.

A chunk's queries go in blocks that only compute against the keys they can see (causal by
absolute position), which halves a long chunk's work next to SDPA's CPU kernel, which
computes the full square and masks it. Over long contexts, whose score matrices outgrow
the cache, PyTorch's CPU flash-attention kernel takes over: once over the cached prefix,
once causally over the chunk itself, the two merged by log-sum-exp. Decode tokens' keys are
gathered into a buffer for one batched matmul, the softmax is masked by context length,
and the values are never copied: embedding_bag sums the probability-weighted value rows
straight from the cache.

Attention sinks (gpt-oss) join each softmax as one more column, the layer's logit for the
row's head, which is dropped before the values are summed; on the flash path each row's
output is scaled by its share of the denominator, sigmoid(log-sum-exp - sink).

An 8-bit cache (gpu_worker.kv_quant) is gathered and dequantized row by row where needed
(embedding_bag cannot read codes, so its decode multiplies gathered values instead).
PyTorch agrees with the native kernels only to float tolerance (not `row_invariant`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention.base import (
    QUERY_BLOCK,
    AttentionBackend,
    DecodeGroup,
    LayerAttention,
    PrefillChunk,
)
from gpu_worker.kv_cache import LayerKV
from gpu_worker.kv_quant import KV_CACHE_DTYPES, as_bytes, dequantize

# Past this many keys, a query block's score matrices (bfloat16 scores, float32 and
# bfloat16 probabilities for 128 queries of 9 heads: 19 MB at 2048 keys) outgrow the CPU's
# last-level cache and the blocked path slows down sharply; the flash kernel, which holds
# no score matrix, takes over (BENCHMARKS.md has the A/B). PyTorch has it for CPUs only.
FLASH_MIN_CONTEXT = 2048


# (output [B, heads, n, d], log-sum-exp [B, heads, n] in float32) of q, k, v [B, heads, n, d]
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class TorchChunk:
    """A chunk's rows of the cache seen as [kv_heads * blocks, ...] that hold its context,
    head by head (None when it starts at 0 and attends only to itself), and a
    [QUERY_BLOCK, QUERY_BLOCK] tile, -inf above the diagonal.

    In a windowed layer the rows start at the first block any query sees (`first_key`
    is that block's first position), and each query block has its own mask over the keys
    it sees, from `window_masks` (first key position, [size, keys] 0 or -inf)."""

    cache_rows: torch.Tensor | None
    causal_tile: torch.Tensor
    first_key: int = 0
    window_masks: list[tuple[int, torch.Tensor]] | None = None


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


class TorchAttention(AttentionBackend):
    name = "torch"
    row_invariant = False
    paged = False
    windows = True
    softcap = True
    sinks = True

    def decode_group(
        self, group: DecodeGroup, cache_like: torch.Tensor, group_size: int
    ) -> DecodeGroup:
        group.prepared = _decode_gather(
            group.block_tables, group.context_lens, cache_like, group_size, group.layer.window
        )
        return group

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        kv_heads, cache_blocks, block_size = cache_like.shape[:3]
        window = chunk.layer.window
        first_block = 0 if window is None else max(0, chunk.start - window + 1) // block_size
        # An 8-bit cache is read back for the chunk's own keys too: they must be the
        # values later steps will see.
        cache_rows = None
        if chunk.start > 0 or cache_like.dtype in KV_CACHE_DTYPES.values():
            heads = torch.arange(kv_heads, device=table.device)[:, None] * cache_blocks
            rows = (heads + table[first_block:]).reshape(-1)
            cache_rows = rows.to(cache_like.device, non_blocking=True)
        dtype = _score_dtype(cache_like)
        tile = causal_tile(dtype, cache_like.device)
        chunk.prepared = TorchChunk(cache_rows, tile, first_block * block_size)
        if window is not None:
            chunk.prepared.window_masks = _window_masks(chunk, window, dtype, cache_like.device)
        return chunk

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        return _gathered_decode_attention(q, kv, group.prepared, group.layer)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        if cpu_flash_serves(q.device, chunk, kv):
            return _flash_prefill_attention(q, k, v, kv, chunk)
        return _blocked_prefill_attention(q, k, v, kv, chunk)

    def decode_sinks(
        self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup, sinks: torch.Tensor
    ) -> torch.Tensor:
        return _gathered_decode_attention(q, kv, group.prepared, group.layer, sinks)

    def prefill_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        chunk: PrefillChunk,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        if cpu_flash_serves(q.device, chunk, kv):
            return _flash_prefill_attention(q, k, v, kv, chunk, sinks)
        return _blocked_prefill_attention(q, k, v, kv, chunk, sinks)


def cpu_flash_serves(device: torch.device, chunk: PrefillChunk, kv: LayerKV) -> bool:
    """Whether PyTorch's CPU flash kernel takes a chunk: a long context, of a cache of the
    model's dtype, on a CPU (there is no such kernel for any other device), in a layer
    without a window or soft-capping (a windowed chunk's blocks see few keys anyway)."""
    return (
        chunk.context_len > FLASH_MIN_CONTEXT
        and device.type == "cpu"
        and not kv.quantized
        and chunk.layer.window is None
        and chunk.layer.softcap is None
    )


def _window_masks(
    chunk: PrefillChunk, window: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[int, torch.Tensor]]:
    """Each query block's first visible key position and its mask over keys from there to
    its last query: -inf past a query (causal) or `window` or more positions before it."""
    masks = []
    for first in range(chunk.start, chunk.context_len, QUERY_BLOCK):
        end = min(first + QUERY_BLOCK, chunk.context_len)
        lowest = max(0, first - window + 1)
        queries = torch.arange(first, end, device=device)[:, None]
        keys = torch.arange(lowest, end, device=device)[None, :]
        hidden = (keys > queries) | (keys <= queries - window)
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -math.inf)
        masks.append((lowest, mask))
    return masks


def _decode_gather(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
    window: int | None = None,
) -> DecodeGather:
    device = block_tables.device
    kv_heads, cache_blocks, block_size, head_dim = cache_like.shape
    key_pos = torch.arange(block_tables.shape[1] * block_size, device=device)[None, :]
    if window is not None:
        # Each row's table from the block its window starts in: at most the window's blocks.
        block_tables, key_pos = _window_tables(block_tables, context_lens, window, block_size)
    batch, width = block_tables.shape
    keys_per_seq = width * block_size
    visible = key_pos < context_lens[:, None]
    if window is not None:
        visible &= key_pos >= context_lens[:, None] - window
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


def _window_tables(
    tables: torch.Tensor, lens: torch.Tensor, window: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows' tables [B, W] cut to the blocks their windows reach -> ([B, W'] tables,
    [B, W' * block_size] each column's position); tensor ops only (graph capture)."""
    width = min(tables.shape[1], -(-window // block_size) + 1)
    first = (lens - window).clamp(min=0) // block_size
    columns = first[:, None] + torch.arange(width, device=tables.device)
    slots = torch.arange(block_size, device=tables.device)
    # Columns past a table's end repeat its last block, at positions past every context.
    positions = (columns[:, :, None] * block_size + slots).reshape(len(tables), -1)
    return tables.gather(1, columns.clamp(max=tables.shape[1] - 1)), positions


def _blocked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerKV,
    chunk: PrefillChunk,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """As _prefill_attention, with matmuls over query blocks; `sinks` [heads], the layer's
    attention sinks.

    Query block [i, e) sees keys [0, start + e): every key before start + i is visible to
    all its queries, so only the last e - i columns need the causal triangle. In a
    windowed layer it sees keys from its first query's window on, under its own mask.
    """
    num_queries, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group_size = heads // kv_heads
    prepared, layer = chunk.prepared, chunk.layer
    if prepared.cache_rows is None:
        keys, values = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    else:
        length = chunk.context_len - prepared.first_key
        keys = _gather(kv.k, kv.k_scales, prepared.cache_rows, length, q.dtype)
        values = _gather(kv.v, kv.v_scales, prepared.cache_rows, length, q.dtype)
    scale, unused = layer.scale_for(head_dim), q.new_zeros(())  # beta=0: baddbmm ignores it
    out = q.new_empty(q.shape)
    grouped = q.view(num_queries, kv_heads, group_size, head_dim)
    # each score row's sink: [kv_heads, group, 1, 1], broadcast over its queries
    sink_logits = None if sinks is None else sinks.view(kv_heads, group_size, 1, 1)
    for index, first in enumerate(range(0, num_queries, QUERY_BLOCK)):
        end = min(first + QUERY_BLOCK, num_queries)
        size, visible = end - first, chunk.start + end
        lowest = 0 if prepared.window_masks is None else prepared.window_masks[index][0]
        seen = slice(lowest - prepared.first_key, visible - prepared.first_key)
        # The query heads of one key/value head as that head's rows: [kv_heads, group * size, d].
        block = grouped[first:end].permute(1, 2, 0, 3).reshape(kv_heads, -1, head_dim)
        # As in decode: scaled inside the matmul, softmax in float32.
        scores = torch.baddbmm(unused, block, keys[:, seen].transpose(1, 2), beta=0, alpha=scale)
        scores = scores.view(kv_heads, group_size, size, visible - lowest)
        if layer.softcap is not None:
            scores = _softcapped(scores, layer.softcap)
        if prepared.window_masks is None:
            scores[..., visible - size :].add_(prepared.causal_tile[:size, :size])
        else:
            scores.add_(prepared.window_masks[index][1])
        probs = _softmax(scores, sink_logits, q.dtype)
        probs = probs.view(kv_heads, -1, visible - lowest)
        block_out = torch.bmm(probs, values[:, seen])
        by_query = block_out.view(kv_heads, group_size, size, head_dim).permute(2, 0, 1, 3)
        out[first:end] = by_query.reshape(size, heads, head_dim)
    return out


def _softmax(
    scores: torch.Tensor, sink_logits: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The probabilities of `scores` [..., keys], computed in float32 and rounded to `dtype`;
    with `sink_logits` (broadcast to [..., 1]), each row's sink joins the denominator."""
    if sink_logits is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    sink_column = sink_logits.to(scores.dtype).expand(*scores.shape[:-1], 1)
    with_sinks = torch.cat([scores, sink_column], dim=-1)
    return torch.softmax(with_sinks, dim=-1, dtype=torch.float32)[..., :-1].to(dtype).contiguous()


def _softcapped(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft-capping, as transformers: cap * tanh(score / cap)."""
    return torch.tanh(scores / cap) * cap


def _flash_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerKV,
    chunk: PrefillChunk,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """As _blocked_prefill_attention, for long contexts.

    Two flash-attention passes, which never hold a score matrix: the queries over the
    cached prefix (every key visible, no mask) and over the chunk's own keys (plain causal,
    square), merged by their log-sum-exps; with `sinks`, each row then weighted by its
    keys' share of a denominator that holds its sink too.
    """
    num_queries, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group_size = heads // kv_heads
    scale = chunk.layer.scale_for(head_dim)
    # [1, heads, n, d]; the kernel needs one key/value head per query head.
    own_keys = k.transpose(0, 1).repeat_interleave(group_size, 0)[None]
    own_values = v.transpose(0, 1).repeat_interleave(group_size, 0)[None]
    out, lse = _FLASH(q.transpose(0, 1)[None], own_keys, own_values, is_causal=True, scale=scale)
    if chunk.prepared.cache_rows is not None:
        # Without a mask, the query heads of one key/value head are just more query rows.
        grouped = q.view(num_queries, kv_heads, group_size, head_dim).permute(1, 2, 0, 3)
        keys = _gather(kv.k, None, chunk.prepared.cache_rows, chunk.start, q.dtype)[None]
        values = _gather(kv.v, None, chunk.prepared.cache_rows, chunk.start, q.dtype)[None]
        queries = grouped.reshape(1, kv_heads, -1, head_dim)
        prefix_out, prefix_lse = _FLASH(queries, keys, values, scale=scale)
        out, lse = _merge(
            prefix_out.view(1, heads, num_queries, head_dim),
            prefix_lse.reshape(1, heads, num_queries),
            out,
            lse,
        )
    if sinks is not None:
        # the keys' share of exp(lse) + exp(sink): a sink is a key whose value is zero
        share = torch.sigmoid(lse - sinks.float().view(1, heads, 1)).unsqueeze(-1)
        out = (out.float() * share).to(out.dtype)
    return out[0].transpose(0, 1)


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets -> attention over their union, and its
    log-sum-exp.

    Each part is weighted by its share of the softmax denominator, exp(lse_a) / (exp(lse_a)
    + exp(lse_b)) = sigmoid(lse_a - lse_b) for part a, computed in float32.
    """
    weight_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    merged = torch.lerp(out_b.float(), out_a.float(), weight_a)
    return merged.to(out_a.dtype), torch.logaddexp(lse_a, lse_b)


def _gathered_decode_attention(
    q: torch.Tensor,
    kv: LayerKV,
    group: DecodeGather,
    layer: LayerAttention,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """As _decode_attention, in PyTorch; `sinks` [heads], the layer's attention sinks.

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
    queries = queries.reshape(kv_heads * batch, group_size, head_dim)
    scale = layer.scale_for(head_dim)
    if layer.softcap is None:
        scores = torch.baddbmm(group.bias.to(q.dtype), queries, keys.transpose(1, 2), alpha=scale)
    else:  # capped before the mask
        scores = _softcapped(torch.bmm(queries, keys.transpose(1, 2)) * scale, layer.softcap)
        scores = scores + group.bias.to(q.dtype)
    # each score row's sink: rows are (kv head, sequence), columns the group's query heads
    sink_logits = None
    if sinks is not None:
        by_head = sinks.view(kv_heads, 1, group_size, 1).expand(kv_heads, batch, group_size, 1)
        sink_logits = by_head.reshape(kv_heads * batch, group_size, 1)
    probs = _softmax(scores, sink_logits, q.dtype)
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


def causal_tile(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tile = torch.full((QUERY_BLOCK, QUERY_BLOCK), -math.inf, dtype=dtype, device=device)
    return tile.triu_(diagonal=1)
