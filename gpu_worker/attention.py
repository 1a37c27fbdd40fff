"""Paged attention in plain PyTorch.

Each layer's cache is a pair of tensors [kv_heads, num_blocks, block_size, head_dim]; a
sequence's token at absolute position p lives in slot p % block_size of block
block_table[p // block_size]. Heads come first so that gathering a sequence's blocks
yields, per head, one contiguous [tokens, head_dim] matrix: what the matmuls want.

The model has written the new tokens' K/V into their slots (with the rotary embedding,
layer_ops.rope_and_cache_) before a layer attends:

- prefill chunks (sequences with several new tokens), one at a time: a chunk that starts
  at position 0 attends over its own K/V; a later chunk gathers the sequence's cached
  prefix from its blocks. Queries go in blocks that only compute against the keys they
  can see (causal by absolute position), which halves a long chunk's work next to SDPA's
  CPU kernel, which computes the full square and masks it. Over long contexts, whose score
  matrices outgrow the cache, PyTorch's CPU flash-attention kernel takes over: once over the
  cached prefix, once causally over the chunk itself, the two merged by log-sum-exp. On a
  CPU with AVX512-BF16, bfloat16 chunks go to a C++ kernel instead (gpu_worker.native),
  which reads the cache itself; on other CPUs (and in float32) the native decode kernel
  takes the chunk's rows, one query each, where it builds;
- decode tokens (sequences with one new token), all together, over their block tables
  padded to a common width: the keys are gathered into a buffer shared by every layer
  for one batched matmul, the softmax is masked by context length, and the values are
  never copied: embedding_bag sums the probability-weighted value rows straight from
  the cache. With one query per sequence this is memory-bound, and on a CPU it runs
  several times faster than SDPA's kernel over gathered K and V. On a CPU, a C++ kernel
  (gpu_worker.native) does better still when it builds: it walks the block tables itself
  and reads each K/V byte once.

The index tensors and buffers are built once per step and shared by every layer, so the
per-layer work is a handful of kernels with no host synchronisation.

With the native kernels a query row gets the same bits whatever else is in the step and
whether it is a decode row or a row of a prefill chunk, so recompute after a preemption
reproduces the tokens decoded before it, in bfloat16 too. The PyTorch paths (CUDA, or no
compiler) agree with them only to float tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker import native

QUERY_BLOCK = 128  # prefill queries per attention block
# Past this many keys, a query block's score matrices (bfloat16 scores, float32 and
# bfloat16 probabilities for 128 queries of 9 heads: 19 MB at 2048 keys) outgrow the CPU's
# last-level cache and the blocked path slows down sharply; the flash kernel, which holds
# no score matrix, takes over (BENCHMARKS.md has the A/B).
FLASH_MIN_CONTEXT = 2048
# (output [B, heads, n, d], log-sum-exp [B, heads, n] in float32) of q, k, v [B, heads, n, d]
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class PrefillChunk:
    rows: slice  # the chunk's rows in the flattened batch
    # Rows of the cache seen as [kv_heads * blocks, ...] that hold the context, head by head;
    # None when the chunk starts at 0 and attends only to itself.
    cache_rows: torch.Tensor | None
    start: int  # absolute position of the chunk's first token
    context_len: int  # start position + number of new tokens
    causal_tile: torch.Tensor  # [QUERY_BLOCK, QUERY_BLOCK]: -inf above the diagonal
    block_table: torch.Tensor  # [W] the sequence's blocks, for the native kernel
    # Where the chunk's rows run through the native decode kernel (see _prefill_attention):
    # each row's block table [n, blocks] and context length [n]; None elsewhere.
    row_tables: torch.Tensor | None = None
    row_lens: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeGather:
    """The PyTorch decode path's index tensors and key buffer."""

    key_rows: torch.Tensor  # [kv_heads * B * W] rows of the cache seen as [heads * blocks, ...]
    bias: torch.Tensor  # [kv_heads * B, 1, W * block_size]: 0 for a visible key, -inf past the end
    keys: torch.Tensor  # [kv_heads * B * W, block_size * head_dim] gather buffer
    # One bag per (kv head, sequence, query head of the group): the flat value-cache rows
    # of the sequence's key slots, in the order of the softmax's columns.
    bag_rows: torch.Tensor  # [kv_heads * B * group * W * block_size]
    bag_offsets: torch.Tensor  # [kv_heads * B * group]


@dataclass(slots=True)
class DecodeGroup:
    rows: slice | torch.Tensor  # rows of the flattened batch that are single-token sequences
    block_tables: torch.Tensor  # [B, W]
    context_lens: torch.Tensor  # [B]
    gather: DecodeGather | None  # None where the native kernel reads the cache itself


@dataclass(slots=True)
class AttentionMetadata:
    slots: torch.Tensor  # [T] flat cache slot of each new token
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    num_tokens: int

    @property
    def decode_only(self) -> bool:
        return not self.prefills


def decode_group(
    rows: slice | torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
    use_native: bool = True,
) -> DecodeGroup:
    """Tensor ops only, so a CUDA graph can capture it with static inputs.

    `cache_like` is any layer's cache tensor (it gives shapes and dtype); `group_size`
    the number of query heads per key/value head. The native kernel runs where
    `use_native` allows it and it is available: on CPU caches, when it builds.
    """
    gather = None
    if not (use_native and _native_kernel(cache_like) is not None):
        gather = _decode_gather(block_tables, context_lens, cache_like, group_size)
    return DecodeGroup(rows, block_tables, context_lens, gather)


def _native_kernel(cache_like: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The C++ decode kernel for this cache, or None (CUDA keeps the PyTorch path)."""
    kernels = native.kernels() if cache_like.device.type == "cpu" else None
    return None if kernels is None else kernels.paged_decode_attention


def _native_prefill_kernel(q: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The C++ prefill kernel where it serves q: bfloat16 on a CPU with AVX512-BF16."""
    if not (q.device.type == "cpu" and q.dtype == torch.bfloat16):
        return None
    head_dim = q.shape[-1]
    kernels = native.kernels() if head_dim % 32 == 0 and head_dim <= 256 else None
    return getattr(kernels, "paged_prefill_attention", None)


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
    bias = torch.zeros(visible.shape, dtype=cache_like.dtype, device=device)
    bias.masked_fill_(~visible, -math.inf)
    slots = block_tables[:, :, None] * block_size + torch.arange(block_size, device=device)
    heads = torch.arange(kv_heads, device=device)
    key_rows = (heads[:, None] * cache_blocks + block_tables.reshape(1, -1)).reshape(-1)
    bag_rows = heads.view(-1, 1, 1, 1) * (cache_blocks * block_size) + slots.view(1, batch, 1, -1)
    bags = kv_heads * batch * group_size
    return DecodeGather(
        key_rows=key_rows,
        bias=bias.repeat(kv_heads, 1).view(kv_heads * batch, 1, keys_per_seq),
        keys=cache_like.new_empty((kv_heads * batch * width, block_size * head_dim)),
        bag_rows=bag_rows.expand(kv_heads, batch, group_size, keys_per_seq).reshape(-1),
        bag_offsets=torch.arange(0, bags * keys_per_seq, keys_per_seq, device=device),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """New tokens' q [T, heads, d] and k/v [T, kv_heads, d] -> attention output [T, heads * d].

    The new tokens' K/V must already be in their cache slots (layer_ops.rope_and_cache_).
    """
    num_tokens = q.shape[0]
    group = meta.decode
    if group is not None and meta.decode_only:
        return _decode_attention(q, k_cache, v_cache, group).reshape(num_tokens, -1)
    out = q.new_empty(q.shape)
    for chunk in meta.prefills:
        rows = chunk.rows
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
    if group is not None:
        out[group.rows] = _decode_attention(q[group.rows], k_cache, v_cache, group)
    return out.view(num_tokens, -1)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
) -> torch.Tensor:
    """One sequence's chunk: q [n, heads, d] -> [n, heads, d].

    A row must get the bits the same token gets as a decode row (recompute after a
    preemption prefills tokens that were decoded before): the native prefill kernel shares
    the decode kernel's arithmetic; where it does not serve, the decode kernel itself takes
    the chunk's rows, one query each.
    """
    scale = q.shape[-1] ** -0.5
    kernel = _native_prefill_kernel(q)
    if kernel is not None:
        return kernel(q, k_cache, v_cache, chunk.block_table, chunk.start, scale)
    if chunk.row_tables is not None:
        decode_kernel = _native_kernel(k_cache)
        return decode_kernel(q, k_cache, v_cache, chunk.row_tables, chunk.row_lens, scale)
    if chunk.context_len > FLASH_MIN_CONTEXT:
        return _flash_prefill_attention(q, k, v, k_cache, v_cache, chunk)
    return _blocked_prefill_attention(q, k, v, k_cache, v_cache, chunk)


def _blocked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
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
        keys = _gather(k_cache, chunk.cache_rows, chunk.context_len)
        values = _gather(v_cache, chunk.cache_rows, chunk.context_len)
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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
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
        keys = _gather(k_cache, chunk.cache_rows, chunk.start)[None]
        values = _gather(v_cache, chunk.cache_rows, chunk.start)[None]
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


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    """q [B, heads, d] -> [B, heads, d]."""
    if group.gather is not None:
        return _gathered_decode_attention(q, k_cache, v_cache, group.gather)
    kernel = _native_kernel(k_cache)
    tables, lens = group.block_tables, group.context_lens
    return kernel(q, k_cache, v_cache, tables, lens, q.shape[-1] ** -0.5)


def _gathered_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGather
) -> torch.Tensor:
    """As _decode_attention, in PyTorch.

    The query heads that share a key/value head become that head's query rows, so grouped-
    query attention needs no copy of K per query head: (kv_heads * B) small matmuls of
    [group, d] x [d, keys].
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group_size = heads // kv_heads
    # Whole blocks of one head are contiguous rows of the cache seen as 2-D: index_select
    # copies those at memcpy speed (selecting along dim 1 of the 4-D view does not).
    torch.index_select(_as_rows(k_cache), 0, group.key_rows, out=group.keys)
    keys = group.keys.view(kv_heads * batch, -1, head_dim)
    queries = q.view(batch, kv_heads, group_size, head_dim).transpose(0, 1)
    # Scale and mask inside the matmul: the same values as scaling and masking a float32
    # copy of the scores afterwards, without those passes over them. The softmax still
    # computes in float32 (a bfloat16 softmax changes greedy tokens across schedules).
    scores = torch.baddbmm(
        group.bias,
        queries.reshape(kv_heads * batch, group_size, head_dim),
        keys.transpose(1, 2),
        alpha=head_dim**-0.5,
    )
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = F.embedding_bag(
        group.bag_rows,
        v_cache.view(-1, head_dim),
        group.bag_offsets,
        mode="sum",
        per_sample_weights=probs.view(-1),
    )
    return (
        out.view(kv_heads, batch, group_size, head_dim)
        .transpose(0, 1)
        .reshape(batch, heads, head_dim)
    )


def _as_rows(cache: torch.Tensor) -> torch.Tensor:
    """[kv_heads, blocks, block_size, d] -> [kv_heads * blocks, block_size * d] (a view)."""
    return cache.view(cache.shape[0] * cache.shape[1], -1)


def _gather(cache: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens -> [kv_heads, length, d]."""
    gathered = _as_rows(cache).index_select(0, rows)
    return gathered.view(cache.shape[0], -1, cache.shape[3])[:, :length]


def build_metadata(
    num_tokens: list[int],
    start_pos: list[int],
    block_tables: torch.Tensor,
    slots: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
) -> AttentionMetadata:
    """Index tensors of one mixed step, shared by every layer.

    `block_tables` is the plan's tables padded to a common width ([S, W], on the host);
    `slots` the flat cache slot of each new token, already on the device; `cache_like`
    any layer's cache tensor; `group_size` the query heads per key/value head.
    """
    prefills: list[PrefillChunk] = []
    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    tile = causal_tile(cache_like.dtype, cache_like.device)
    row = 0
    for seq, (count, start) in enumerate(zip(num_tokens, start_pos, strict=True)):
        if count == 1:
            decode_seqs.append(seq)
            decode_rows.append(row)
        else:
            chunk = _prefill_chunk(seq, row, count, start, block_tables, cache_like, tile)
            prefills.append(chunk)
        row += count
    decode = None
    if decode_seqs:
        decode = _decode_group_for(
            decode_seqs, decode_rows, start_pos, block_tables, cache_like, group_size
        )
    return AttentionMetadata(slots=slots, decode=decode, prefills=prefills, num_tokens=row)


def causal_tile(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tile = torch.full((QUERY_BLOCK, QUERY_BLOCK), -math.inf, dtype=dtype, device=device)
    return tile.triu_(diagonal=1)


def _prefill_chunk(
    seq: int,
    row: int,
    count: int,
    start: int,
    block_tables: torch.Tensor,
    cache_like: torch.Tensor,
    tile: torch.Tensor,
) -> PrefillChunk:
    kv_heads, cache_blocks, block_size = cache_like.shape[:3]
    num_blocks = -(-(start + count) // block_size)
    cache_rows = None
    if start > 0:
        heads = torch.arange(kv_heads)[:, None] * cache_blocks
        rows = (heads + block_tables[seq, :num_blocks]).reshape(-1)
        cache_rows = rows.to(cache_like.device, non_blocking=True)
    chunk = PrefillChunk(
        rows=slice(row, row + count),
        cache_rows=cache_rows,
        start=start,
        context_len=start + count,
        causal_tile=tile,
        block_table=block_tables[seq],
    )
    if _rows_run_as_decode_queries(cache_like):
        chunk.row_tables = block_tables[seq, :num_blocks].expand(count, -1).contiguous()
        chunk.row_lens = torch.arange(start + 1, start + count + 1)
    return chunk


def _rows_run_as_decode_queries(cache_like: torch.Tensor) -> bool:
    """Whether prefill rows go to the native decode kernel: no prefill kernel, but that one."""
    probe = cache_like[:0, 0, 0]  # a q-like tensor: the cache's dtype, device and head_dim
    return _native_prefill_kernel(probe) is None and _native_kernel(cache_like) is not None


def _decode_group_for(
    seqs: list[int],
    rows: list[int],
    start_pos: list[int],
    block_tables: torch.Tensor,
    cache_like: torch.Tensor,
    group_size: int,
) -> DecodeGroup:
    device = cache_like.device
    block_size = cache_like.shape[2]
    context_lens = [start_pos[s] + 1 for s in seqs]
    width = -(-max(context_lens) // block_size)
    tables = block_tables[seqs, :width].to(device, non_blocking=True)
    lens = torch.tensor(context_lens, device=device)
    contiguous = rows[-1] - rows[0] == len(rows) - 1
    row_index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
    return decode_group(row_index, tables, lens, cache_like, group_size)
