"""FlexAttention, the CUDA backend: PyTorch's FlexAttention compiled through Triton, over
the whole cache seen as one long key sequence.

A block mask built from the block tables lists, for each query block, the cache blocks it
reads (its sequence's, in order), so decode rows and prefill chunks read K/V in place, each
byte once per query tile, and nothing is gathered: no temporary outside the KV budget.
Blocks every query of a tile sees whole skip the mask; in the others a mask_mod maps a
cache slot back to its position in the sequence. On a CPU FlexAttention runs eagerly,
densely over every cache slot: a reference that tests the masks, not a kernel to serve with.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from gpu_worker.attention.base import (
    QUERY_BLOCK,
    AttentionBackend,
    DecodeGroup,
    LayerAttention,
    PrefillChunk,
)
from gpu_worker.kv_cache import LayerKV


class FlexAttention(AttentionBackend):
    name = "flex"
    row_invariant = False
    windows = True
    softcap = True

    def decode_group(
        self, group: DecodeGroup, cache_like: torch.Tensor, group_size: int
    ) -> DecodeGroup:
        block_size = cache_like.shape[2]
        lens = group.context_lens[:, None]
        group.prepared = paged_block_mask(
            group.block_tables,
            group.context_lens - 1,
            (lens + block_size - 1) // block_size,
            lens // block_size,
            1,
            cache_like,
            group.layer.window,
        )
        return group

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        device, block_size = cache_like.device, cache_like.shape[2]
        count = chunk.context_len - chunk.start
        # Query tile m holds the chunk's queries [m * QUERY_BLOCK, (m + 1) * QUERY_BLOCK).
        firsts = chunk.start + torch.arange(0, count, QUERY_BLOCK)
        lasts = torch.clamp(firsts + QUERY_BLOCK, max=chunk.context_len) - 1
        chunk.prepared = paged_block_mask(
            table[None].to(device, non_blocking=True),
            torch.tensor([chunk.start], device=device),
            (lasts // block_size + 1)[None].to(device, non_blocking=True),
            ((firsts + 1) // block_size)[None].to(device, non_blocking=True),
            count,
            cache_like,
            chunk.layer.window,
        )
        return chunk

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        return _flex(q[:, :, None], kv, group.prepared, group.layer)[:, :, 0]

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        """The chunk's own K/V are read back from the cache, where they already are."""
        queries = q.transpose(0, 1)[None]
        return _flex(queries, kv, chunk.prepared, chunk.layer)[0].transpose(0, 1)


def paged_block_mask(
    tables: torch.Tensor,
    q_first: torch.Tensor,
    counts: torch.Tensor,
    full: torch.Tensor,
    q_len: int,
    cache_like: torch.Tensor,
    window: int | None = None,
) -> BlockMask:
    """The block mask of `q_len` queries per sequence over the cache seen as one key sequence.

    tables [B, W]: each sequence's cache blocks; q_first [B]: the absolute position of its
    first query (query i sits at q_first + i and sees positions up to it); counts and full
    [B, tiles]: how many of its blocks query tile m sees at all, and how many whole (the
    first ones). Tensor ops only, so that a CUDA graph can capture it.

    The mask_mod finds a cache slot's position through the block's index in the tables:
    a block sits at one index in every table that holds it (its keys are rotated for those
    positions; a shared prefix block is shared at its place), the scratch block aside,
    which holds nothing anyone sees, and the blocks behind a row's window.

    With a sliding `window`, a query also sees no key `window` or more positions before
    it: no block is listed whole then (the mask_mod drops the keys behind the window), and
    a tile's list starts at the first block its first query's window reaches.
    """
    batch, width = tables.shape
    cache_blocks, block_size = cache_like.shape[1], cache_like.shape[2]
    first = full  # a tile's partly visible blocks follow its whole ones in the table
    if window is not None:
        tiles = torch.arange(counts.shape[1], device=tables.device)
        lowest = (q_first[:, None] + QUERY_BLOCK * tiles - window + 1).clamp(min=0)
        first = torch.minimum(lowest // block_size, counts)
        full = torch.zeros_like(full)
    columns = torch.arange(width, device=tables.device)
    index_of = torch.zeros(cache_blocks + 1, dtype=torch.long, device=tables.device)
    placed = tables
    if window is not None:
        # Blocks wholly behind a row's window may have gone to other sequences (the
        # service frees them; the table keeps their places): they place nothing.
        behind = (q_first - window + 1).clamp(min=0) // block_size
        placed = torch.where(columns < behind[:, None], cache_blocks, tables)
    index_of.scatter_(0, placed.reshape(-1), columns.repeat(batch))
    in_order = tables[:, None, :].expand(-1, counts.shape[1], -1)
    partial = in_order.gather(2, (first[..., None] + columns).clamp(max=width - 1))

    def visible(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = kv_idx // block_size
        index = index_of[block]
        position = index * block_size + kv_idx % block_size
        seen = (tables[b, index] == block) & (position <= q_first[b] + q_idx)
        if window is None:
            return seen
        return seen & (position > q_first[b] + q_idx - window)

    return BlockMask.from_kv_blocks(
        _per_tile(counts - first),
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


def _flex(q: torch.Tensor, kv: LayerKV, mask: BlockMask, layer: LayerAttention) -> torch.Tensor:
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
        score_mod=None if layer.softcap is None else _softcap_mod(layer.softcap),
        scale=layer.scale_for(head_dim),
        enable_gqa=q.shape[1] != kv_heads,
        kernel_options=_kernel_options(mask) if on_cuda else None,
    )


@functools.cache
def _softcap_mod(cap: float) -> Any:
    """Gemma 2's soft-capping as a score_mod (applied before the mask, as transformers)."""

    def capped(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return capped


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
