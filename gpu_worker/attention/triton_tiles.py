"""What cadence's two Triton attention kernels share: how keys are cut into tiles, how a
tile's cache blocks are found, and the pieces of arithmetic both must do alike.

The decode kernel (triton_backend) and the prompt-chunk kernel (triton_varlen) walk a
sequence's keys in the same tiles, at whole multiples of the tile size, so that a tile
sits inside one cache block or spans whole ones, and read a tile's block ids from the
table a tile ahead. Triton is imported with this module: gpu_worker.kernels imports the
kernels on CUDA alone.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_KEY_TILE = 128
TILE_ELEMENTS = 8192  # of a K or V tile [keys, head_dim padded]
# Triton's CPU interpreter multiplies a bfloat16 dot's raw bits (3.8): there the operands
# go up to float32 first, which gives the same products (a bfloat16 product is exact in it).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def key_tile(block_size: int, head_dim: int) -> int:
    """Keys per loop step: the most whose K (or V) tile fits TILE_ELEMENTS, up to
    MAX_KEY_TILE, and one that lies inside a block or spans whole ones."""
    tile = min(MAX_KEY_TILE, TILE_ELEMENTS // dim_pad(head_dim))
    if tile % block_size == 0 or block_size % tile == 0:
        return tile
    return min(tile, block_size & -block_size)  # the block's largest power-of-two factor


def checked_key_tile(block_size: int, head_dim: int) -> int:
    tile = key_tile(block_size, head_dim)
    if tile < 16:  # tl.dot's least
        raise RuntimeError(
            "TritonAttention needs a block size that is a power of two or a multiple of 16"
        )
    return tile


def dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot's least


def dot_precision(dtype: torch.dtype) -> str:
    """float32 caches are checked to 1e-4: TF32's 10-bit mantissa misses that."""
    return "ieee" if dtype == torch.float32 or INTERPRETED else "tf32"


@triton.jit
def tile_blocks(
    table,
    tile,
    end_block,
    BLOCK_SIZE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
):
    """The cache block of each key of tile `tile` ([KEY_TILE]), from one table entry per
    block the tile spans (a scalar where one block holds the whole tile). Entries past the
    row's context (from `end_block`) are not read: block 0 stands in, its keys masked."""
    index = tile * KEY_TILE // BLOCK_SIZE
    if BLOCKS_PER_TILE == 1:
        blocks = tl.load(table + index, mask=index < end_block, other=0).to(tl.int64)
    else:
        index = index + tl.arange(0, BLOCKS_PER_TILE)
        ids = tl.load(table + index, mask=index < end_block, other=0).to(tl.int64)
        spread = tl.broadcast_to(ids[:, None], (BLOCKS_PER_TILE, KEY_TILE // BLOCKS_PER_TILE))
        blocks = tl.reshape(spread, (KEY_TILE,))
    return blocks


@triton.jit
def tanh(x):
    """tanh from exp2, which every Triton backend and the interpreter have alike."""
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    magnitude = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def join_sink(top, total, acc, sink):
    """An online softmax's running maximum `top`, denominator `total` and weighted values
    `acc` of a tile's rows, with one more logit each, `sink` (log2 units: gpt-oss's
    attention sink), which counts in the maximum and the denominator and weighs no value
    -> the new denominator and values. `top` must be finite (a row saw a key)."""
    new_top = tl.maximum(top, sink)
    fade = tl.exp2(top - new_top)
    return total * fade + tl.exp2(sink - new_top), acc * fade[:, None]
