"""A producer's staging arena: a held prompt's K/V gathered into one contiguous region, so
that a consumer reads it in one segment however fragmented the two caches are.

A pull straight from a cache takes a segment per run of consecutive blocks, cache tensor
and KV head (the cache is [kv_heads, blocks, block_size, ...]); after a few hundred mixed
requests a prompt's blocks are rarely consecutive, and Mooncake's TCP transport pays a fixed
cost per segment, which then outweighs the bytes (BENCHMARKS.md §28). The producer's worker
therefore gathers the prompt into its arena in the step that ends the request (a KvStage,
after the forward pass wrote the blocks, before the result goes back), and its answer names
the region. The service decides where in the arena each prompt goes (the engine's
StagingArena); the worker only copies.

A region of `count` blocks: for each cache tensor (kv_connector.cache_tensors' order), for
each KV head, the blocks in table order. A consumer lands it in one buffer of its own and
scatters it into its blocks, or, when its blocks are one run, reads each tensor and head's
part straight into its cache (no copy after the read; tensors x heads segments).
"""

from __future__ import annotations

import itertools
import math

import torch

from gpu_worker.protocol import KvStage


def block_bytes(tensors: list[torch.Tensor]) -> int:
    """One block's bytes over every cache tensor and KV head: a region's bytes per block."""
    return sum(t.shape[0] * t.stride(1) * t.element_size() for t in tensors)


def allocate_arena(blocks: int, per_block: int, device: torch.device) -> torch.Tensor:
    """The arena's bytes, written once so that a host's memory is taken now, as the cache's
    (the cache is sized from the memory left after it)."""
    return torch.zeros(blocks * per_block, dtype=torch.uint8, device=device)


def region_views(
    region: torch.Tensor, tensors: list[torch.Tensor], count: int
) -> list[torch.Tensor]:
    """`region` (bytes from a region's start) as each cache tensor's part of a region of
    `count` blocks: [kv_heads, count, *the block's shape], of the tensor's dtype."""
    views, at = [], 0
    for tensor in tensors:
        shape = (tensor.shape[0], count, *tensor.shape[2:])
        size = math.prod(shape) * tensor.element_size()
        views.append(region[at : at + size].view(tensor.dtype).view(shape))
        at += size
    return views


def gather(tensors: list[torch.Tensor], arena: torch.Tensor, stage: KvStage) -> None:
    """Copy `stage`'s blocks of the cache into its region of the arena."""
    per_block, count = block_bytes(tensors), len(stage.blocks)
    if stage.offset < 0 or (stage.offset + count) * per_block > arena.numel():
        raise ValueError(
            f"a stage of {count} blocks at block {stage.offset} does not fit the staging "
            f"arena of {arena.numel() // per_block} blocks"
        )
    region = arena[stage.offset * per_block :]
    index = torch.tensor(stage.blocks, device=arena.device)
    for tensor, view in zip(tensors, region_views(region, tensors, count), strict=True):
        torch.index_select(tensor, 1, index, out=view)


def scatter(tensors: list[torch.Tensor], landing: torch.Tensor, blocks: list[int]) -> None:
    """Copy a region landed at the start of `landing` into `blocks` of the cache."""
    index = torch.tensor(blocks, device=landing.device)
    for tensor, view in zip(tensors, region_views(landing, tensors, len(blocks)), strict=True):
        tensor.index_copy_(1, index, view)


def is_one_run(blocks: list[int]) -> bool:
    return all(b == a + 1 for a, b in itertools.pairwise(blocks))
