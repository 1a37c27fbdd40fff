"""Paged attention in plain PyTorch.

Each layer's cache is a pair of tensors [kv_heads, num_blocks, block_size, head_dim]; a
sequence's token at absolute position p lives in slot p % block_size of block
block_table[p // block_size]. Heads come first so that gathering a sequence's blocks
yields, per head, one contiguous [tokens, head_dim] matrix: what the matmuls want.

A step first writes the new tokens' K/V into their slots, then attends:

- prefill chunks (sequences with several new tokens), one SDPA call per chunk: a chunk
  that starts at position 0 attends causally over its own K/V; a later chunk gathers the
  sequence's cached prefix from its blocks and masks by absolute position;
- decode tokens (sequences with one new token), all together, over their block tables
  padded to a common width: the keys are gathered into a buffer shared by every layer
  for one batched matmul, the softmax is masked by context length, and the values are
  never copied: embedding_bag sums the probability-weighted value rows straight from
  the cache. With one query per sequence this is memory-bound, and on a CPU it runs
  several times faster than SDPA's kernel over gathered K and V.

The index tensors and buffers are built once per step and shared by every layer, so the
per-layer work is a handful of kernels with no host synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    rows: slice  # the chunk's rows in the flattened batch
    blocks: torch.Tensor | None  # block ids covering the context; None when the chunk starts at 0
    context_len: int  # start position + number of new tokens
    mask: torch.Tensor | None  # [tokens, context_len] bool: token j sees keys 0..start+j


@dataclass(slots=True)
class DecodeGroup:
    rows: slice | torch.Tensor  # rows of the flattened batch that are single-token sequences
    block_ids: torch.Tensor  # [B * W] the padded block tables, flattened
    bias: torch.Tensor  # [1, B, 1, W * block_size] float32: 0 for a visible key, -inf past the end
    keys: torch.Tensor  # [kv_heads, B * W, block_size, head_dim] gather buffer
    # One bag per (kv head, sequence, query head of the group): the flat value-cache rows
    # of the sequence's key slots, in the order of the softmax's columns.
    bag_rows: torch.Tensor  # [kv_heads * B * group * W * block_size]
    bag_offsets: torch.Tensor  # [kv_heads * B * group]


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
) -> DecodeGroup:
    """Tensor ops only, so a CUDA graph can capture it with static inputs.

    `cache_like` is any layer's cache tensor (it gives shapes and dtype); `group_size`
    the number of query heads per key/value head.
    """
    device = block_tables.device
    batch, width = block_tables.shape
    kv_heads, cache_blocks, block_size, head_dim = cache_like.shape
    keys_per_seq = width * block_size
    key_pos = torch.arange(keys_per_seq, device=device)
    visible = key_pos[None, :] < context_lens[:, None]
    bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, -math.inf)
    slots = block_tables[:, :, None] * block_size + torch.arange(block_size, device=device)
    head_base = torch.arange(kv_heads, device=device) * (cache_blocks * block_size)
    bag_rows = head_base[:, None, None, None] + slots.view(1, batch, 1, keys_per_seq)
    bags = kv_heads * batch * group_size
    return DecodeGroup(
        rows=rows,
        block_ids=block_tables.reshape(-1),
        bias=bias.view(1, batch, 1, -1),
        keys=cache_like.new_empty((kv_heads, batch * width, block_size, head_dim)),
        bag_rows=bag_rows.expand(kv_heads, batch, group_size, keys_per_seq).reshape(-1),
        bag_offsets=torch.arange(0, bags * keys_per_seq, keys_per_seq, device=device),
    )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k/v [T, kv_heads, d] into their slots of the [kv_heads, blocks, block_size, d] caches."""
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """New tokens' q [T, heads, d] and k/v [T, kv_heads, d] -> attention output [T, heads * d]."""
    write_kv(k_cache, v_cache, k, v, meta.slots)
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
    """One sequence's chunk: q [n, heads, d] -> [n, heads, d]."""
    if chunk.blocks is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
    else:
        keys = _gather(k_cache, chunk.blocks, chunk.context_len)
        values = _gather(v_cache, chunk.blocks, chunk.context_len)
    # 4-D inputs: with 3-D ones SDPA leaves its CPU flash kernel for a slow generic path.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    """q [B, heads, d] -> [B, heads, d].

    The query heads that share a key/value head become that head's query rows, so grouped-
    query attention needs no copy of K per query head: (kv_heads * B) small matmuls of
    [group, d] x [d, keys].
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group_size = heads // kv_heads
    torch.index_select(k_cache, 1, group.block_ids, out=group.keys)
    keys = group.keys.view(kv_heads * batch, -1, head_dim)
    queries = q.view(batch, kv_heads, group_size, head_dim).transpose(0, 1)
    scores = torch.bmm(
        queries.reshape(kv_heads * batch, group_size, head_dim), keys.transpose(1, 2)
    )
    scores = scores.view(kv_heads, batch, group_size, -1).float()
    probs = torch.softmax(scores.mul_(head_dim**-0.5).add_(group.bias), dim=-1).to(q.dtype)
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


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens -> [kv_heads, length, d]."""
    gathered = cache.index_select(1, blocks)
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
    device = slots.device
    block_size = cache_like.shape[2]
    prefills: list[PrefillChunk] = []
    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    row = 0
    for seq, (count, start) in enumerate(zip(num_tokens, start_pos, strict=True)):
        if count == 1:
            decode_seqs.append(seq)
            decode_rows.append(row)
        else:
            prefills.append(
                _prefill_chunk(seq, row, count, start, block_tables, block_size, device)
            )
        row += count
    decode = None
    if decode_seqs:
        decode = _decode_group_for(
            decode_seqs, decode_rows, start_pos, block_tables, cache_like, group_size
        )
    return AttentionMetadata(slots=slots, decode=decode, prefills=prefills, num_tokens=row)


def _prefill_chunk(
    seq: int,
    row: int,
    count: int,
    start: int,
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> PrefillChunk:
    rows = slice(row, row + count)
    context_len = start + count
    if start == 0:
        return PrefillChunk(rows=rows, blocks=None, context_len=context_len, mask=None)
    num_blocks = -(-context_len // block_size)
    blocks = block_tables[seq, :num_blocks].to(device, non_blocking=True)
    query_pos = torch.arange(start, context_len, device=device)
    key_pos = torch.arange(context_len, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    return PrefillChunk(rows=rows, blocks=blocks, context_len=context_len, mask=mask)


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
