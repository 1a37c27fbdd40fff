"""cadence's paged attention kernel for prompt chunks, in Triton: the queries of one or
more chunks over the paged cache, in one launch, TritonAttention's prefill on CUDA.

A chunk's keys are its cached prefix and its own new tokens, which the layer has already
written into their cache slots (layer_ops.rope_and_cache_), so the kernel reads every key
through the block table alike. A query at absolute position p sees keys 0..p (and, in a
sliding window, only those after p - window); Gemma 2's soft-capping applies to the scores
before the mask; attention sinks (gpt-oss: a logit per query head) join each row's online
softmax after its last key tile, in the maximum and the denominator, weighing no value.

The tiles. One program takes BLOCK_Q consecutive queries of one chunk and one key/value
head, and the GROUP query heads that share it, packed into one M tile of
BLOCK_M = BLOCK_Q * GROUP rows (row m: query m // GROUP, head m % GROUP), as vLLM's
unified attention does: each key tile's scores are one [BLOCK_M, head_dim] x
[head_dim, KEY_TILE] matmul for all of them, and each K/V byte is read once per program.
The keys come a key tile at a time (triton_tiles: the decode kernel's tiles, their block
ids loaded a tile ahead) from the tile that holds the first query's first visible key to
the one that holds the last query, under an online softmax in float32; the output is q's
dtype. A key is loaded where any of the program's queries sees it, and masked per query;
keys before the first query's window or after the last query are never read.

The launch, from shapes alone. The chunks come as tensors: `cu_q` [chunks + 1], the
cumulative count of their queries; `rows` [chunks], the row of each chunk's first query in
q (and out); `starts` [chunks], the absolute position of each chunk's first query; and
their block tables [chunks, W]. Chunk c's query tiles are programs
cu_q[c] // BLOCK_Q + c onwards (vLLM's numbering), so that the grid,
cdiv(queries, BLOCK_Q) + chunks by key/value heads, covers every chunk's tiles whatever
their lengths; a program finds its chunk by a binary search of those bases (the chunk
count is a value: no variant compiled per count), and one past its chunk's queries returns
at once. No value is read on the host: no synchronisation, and a CUDA graph captured over a
token bucket replays over any chunks that fit it (tests/gpu).

The constants, and why:
- BLOCK_M = 64 rows: 16 queries of a group of 4, 8 of a group of 8, 64 without GQA; a
  group whose size is not a power of two leaves BLOCK_M % GROUP rows idle. With 4 warps,
  the [64, 128] float32 accumulator and a [64, KEY_TILE] score tile stay in registers.
- The key tile is the decode kernel's (128 keys up to head_dim 64, 64 up to 128, 32 at
  256): compiled for sm_90 by Triton 3.9, 72-96 KB of shared memory in 2 stages, wgmma.
- WARPS = 4, STAGES = 2: as the decode kernel, two stages let the pipeliner issue the
  next tile's K/V loads (addresses known a step ahead) while this one computes.
Still to measure on the H200: the mixed step against its 18.4 ms (issue 52);
BLOCK_M 128 (half the K/V reads of a long prompt) and, at head_dim 256, 32 rows or 8 warps
(a [64, 256] accumulator may spill); STAGES 3; skipping the mask on tiles every query sees
whole, as FlashAttention does; and splitting a long prefix across programs (a 512-token
chunk of a group of 4 over 8 KV heads is 256 programs, each walking the whole prefix).

A chunk's rows get the same bits in a launch of their own as among other chunks: its query
tiles are the same. A row's bits should not depend on how its prompt is cut into chunks
either, though that moves its place in its query tile and the key tiles the tile walks: a
key tile the row does not see adds exact zeros (before its window, its running maximum is
still -inf and it subtracts 0; after its own position, its probabilities are 0 and its
running values fade by 2 ** 0), and a GPU's MMA computes a row's products whatever its
place in the tile. tests/gpu checks it on CUDA; Triton's interpreter cannot show it (numpy's
matmul rounds a row differently at another place in the matrix). The rows are not the
decode kernel's bits for the same token, which splits a row's keys into segments and
merges them: TritonAttention does not claim `row_invariant`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_worker.attention.base import LayerAttention
from gpu_worker.attention.triton_tiles import (
    INTERPRETED,
    checked_key_tile,
    dim_pad,
    dot_precision,
    join_sink,
    tanh,
    tile_blocks,
)

BLOCK_M = 64  # query rows of a program: BLOCK_Q queries of GROUP heads each
WARPS, STAGES = 4, 2


@dataclass(slots=True)
class Chunks:
    """One launch's chunks, on the device: `cu_q` [chunks + 1] the cumulative counts of
    their queries, `rows` [chunks] the row of each one's first query in q, `starts`
    [chunks] its absolute position, and `tables` [chunks, W] their block tables."""

    cu_q: torch.Tensor
    rows: torch.Tensor
    starts: torch.Tensor
    tables: torch.Tensor

    @property
    def count(self) -> int:
        return self.tables.shape[0]


def chunks_on(
    device: torch.device,
    rows: list[int],
    counts: list[int],
    starts: list[int],
    tables: torch.Tensor,
) -> Chunks:
    """The launch's records from host facts: one copy to the device for the three index
    lists, and the tables' (non-blocking)."""
    chunks = len(counts)
    cu = [0]
    for count in counts:
        cu.append(cu[-1] + count)
    # Each list at a multiple of 16 bytes: Triton specialises a pointer by its alignment,
    # and a variant per chunk count would compile mid-serving.
    width = -(-(chunks + 1) // 4) * 4
    padded = [[*values, *[0] * (width - len(values))] for values in (cu, rows, starts)]
    packed = torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True)
    tables = tables.to(device, non_blocking=True)
    return Chunks(packed[0, : chunks + 1], packed[1, :chunks], packed[2, :chunks], tables)


def paged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: Chunks,
    layer: LayerAttention,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """The chunks' queries, rows of q [T, heads, d], over caches k, v [kv_heads, blocks,
    block_size, d] -> their rows of out [T, heads, d], contiguous in d (no other row is
    written); `sinks` [heads]: the layer's attention sinks, where it has them. q's rows
    bound the grid: a CUDA graph captured over a token bucket serves any chunks within it."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k.shape[0], k.shape[2]
    tile = checked_key_tile(block_size, head_dim)
    group = heads // kv_heads
    if group > BLOCK_M:
        raise RuntimeError(f"TritonAttention's prefill packs at most {BLOCK_M} heads per KV head")
    block_q = BLOCK_M // group
    if q.stride(2) != 1:  # the kernel steps through a query's dims one element at a time
        q = q.contiguous()
    tables = chunks.tables if chunks.tables.stride(1) == 1 else chunks.tables.contiguous()
    grid = (triton.cdiv(q.shape[0], block_q) + chunks.count, kv_heads)
    _prefill_kernel[grid](
        q,
        k,
        v,
        tables,
        chunks.cu_q,
        chunks.rows,
        chunks.starts,
        sinks,
        out,
        chunks.count,
        *q.stride()[:2],
        *out.stride()[:2],
        *k.stride(),
        *v.stride(),
        tables.stride(0),
        layer.scale_for(head_dim),
        layer.softcap or 1.0,
        layer.window or 0,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=BLOCK_M,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad(head_dim),
        BLOCK_SIZE=block_size,
        KEY_TILE=tile,
        BLOCKS_PER_TILE=max(1, tile // block_size),
        WINDOWED=layer.window is not None,
        SOFTCAP=layer.softcap is not None,
        SINKS=sinks is not None,
        PRECISION=dot_precision(q.dtype),
        UPCAST=INTERPRETED,
        num_warps=WARPS,
        num_stages=STAGES,
    )


@triton.jit(do_not_specialize=["chunk_count", "stride_tb"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    cu_q_ptr,
    rows_ptr,
    starts_ptr,
    sinks_ptr,
    out_ptr,
    chunk_count,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vh,
    stride_vb,
    stride_vs,
    stride_vd,
    stride_tb,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """BLOCK_Q queries of one chunk, the GROUP heads of one key/value head each, over the
    keys they see (SINKS: and their heads' sinks) -> their output rows, normalised, in
    out's dtype."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    chunk = _chunk_of(cu_q_ptr, chunk_count, program, BLOCK_Q)
    first_query = (program - (tl.load(cu_q_ptr + chunk) // BLOCK_Q + chunk)) * BLOCK_Q
    count = tl.load(cu_q_ptr + chunk + 1) - tl.load(cu_q_ptr + chunk)
    if first_query >= count:  # past the chunk's queries
        return
    row0 = tl.load(rows_ptr + chunk).to(tl.int64)
    start = tl.load(starts_ptr + chunk).to(tl.int64)

    m = tl.arange(0, BLOCK_M)
    query = first_query + m // GROUP
    heads = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (query < count)
    # A row past the chunk takes its last query's place: it attends (never stored) and so
    # has a visible key, where an empty row's online softmax would give NaN.
    last = tl.minimum(first_query + BLOCK_Q, count) - 1
    position = start + tl.minimum(query, last)  # [BLOCK_M], absolute
    last_key = start + last  # the program's last query sees keys up to it
    first_key = last_key * 0  # p - window < key <= p for the query at p
    if WINDOWED:
        first_key = tl.maximum(start + first_query - window + 1, 0)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = q_ptr + (row0 + query)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    sink = tl.full([BLOCK_M], float("-inf"), tl.float32)  # none: exact zeros
    if SINKS:  # log2 units, as the scores
        sink = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634
    result = _attend_keys(
        q,
        sink,
        position,
        first_key,
        last_key,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_vh,
        tables_ptr + chunk.to(tl.int64) * stride_tb,
        stride_kb,
        stride_ks,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vd,
        scale,
        softcap,
        window,
        BLOCK_M,
        HEAD_DIM,
        DIM_PAD,
        BLOCK_SIZE,
        KEY_TILE,
        BLOCKS_PER_TILE,
        WINDOWED,
        SOFTCAP,
        SINKS,
        PRECISION,
        UPCAST,
    )
    out_rows = out_ptr + (row0 + query)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(
        out_rows + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _chunk_of(cu_q_ptr, chunk_count, program, BLOCK_Q: tl.constexpr):
    """The chunk whose query tiles hold program `program`: chunk c's start at
    cu_q[c] // BLOCK_Q + c, so the last chunk whose start is not past it (a binary search:
    the chunk count is a value, so that it compiles no variant per count)."""
    low = 0
    high = chunk_count
    while low < high:
        middle = (low + high) // 2
        if tl.load(cu_q_ptr + middle) // BLOCK_Q + middle <= program:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def _attend_keys(
    q,
    sink,
    position,
    first_key,
    last_key,
    k_head,
    v_head,
    table,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    scale,
    softcap,
    window,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Queries q [BLOCK_M, DIM_PAD] at `position` over one key/value head's keys from
    `first_key` to `last_key`, key tile by key tile (SINKS: and each row's `sink`, log2
    units) -> their output, normalised, float32."""
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    end_block = last_key // BLOCK_SIZE + 1
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    lo = first_key // KEY_TILE
    hi = last_key // KEY_TILE + 1
    blocks = tile_blocks(table, lo, end_block, BLOCK_SIZE, KEY_TILE, BLOCKS_PER_TILE)
    for tile in range(lo, hi):
        # The next tile's blocks, a step ahead: this tile's gathers do not wait on them.
        next_blocks = tile_blocks(table, tile + 1, end_block, BLOCK_SIZE, KEY_TILE, BLOCKS_PER_TILE)
        keys = tile * KEY_TILE + tl.arange(0, KEY_TILE)
        slots = keys % BLOCK_SIZE
        loaded = (keys >= first_key) & (keys <= last_key)  # seen by some query here
        kt = tl.load(
            k_head + (blocks * stride_kb + slots * stride_ks)[None, :] + dims[:, None] * stride_kd,
            mask=loaded[None, :] & dim_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        scores = tl.dot(q, kt, input_precision=PRECISION) * scale  # [BLOCK_M, KEY_TILE]
        if SOFTCAP:  # Gemma 2's cap * tanh(score / cap), before the mask
            scores = softcap * tanh(scores / softcap)
        seen = keys[None, :] <= position[:, None]
        if WINDOWED:
            seen = seen & (keys[None, :] > position[:, None] - window)
        scores = tl.where(seen, scores * 1.4426950408889634, float("-inf"))  # log2(e)
        new_top = tl.maximum(top, tl.max(scores, 1))
        # A row may see no key of an early tile (behind its window) while `top` is still
        # -inf: it subtracts 0 there, so that its probabilities are 0, not NaN.
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        fade = tl.exp2(top - shift)
        probs = tl.exp2(scores - shift[:, None])
        total = total * fade + tl.sum(probs, 1)
        vt = tl.load(
            v_head + (blocks * stride_vb + slots * stride_vs)[:, None] + dims[None, :] * stride_vd,
            mask=loaded[:, None] & dim_ok[None, :],
            other=0.0,
        )
        probs = probs.to(v_head.dtype.element_ty)  # the cache's dtype, as the MMA takes it
        if UPCAST:
            vt = vt.to(tl.float32)
            probs = probs.to(tl.float32)
        acc = acc * fade[:, None] + tl.dot(probs, vt, input_precision=PRECISION)
        top = new_top
        blocks = next_blocks

    if SINKS:  # every row saw its own key: `top` is finite
        total, acc = join_sink(top, total, acc, sink)
    return acc / total[:, None]  # every row saw its own key: total >= 1
