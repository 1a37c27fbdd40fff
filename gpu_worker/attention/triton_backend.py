"""TritonAttention: cadence's own paged attention kernels, written in Triton, offered on
CUDA beside FlexAttention: the decode kernel here, and the prompt chunks' kernel in
triton_varlen, which attends all of a step's chunks in one launch per layer
(`prefill_step`, `prefill_all`). Their shared tiles are triton_tiles'. Both read nothing
on the host, so a mixed step is attended from static records as well
(`attend_captured`, gpu_worker.static_records) and captured whole, one graph per token
bucket (gpu_worker.mixed_graphs).

A decode step is one query per row, so its cost is reading each row's K/V; the kernel reads
them in place through the block tables, each byte once. One program takes a (row, key/value
head, segment of the row's keys): the query heads that share the key/value head come in as
one tile (padded to 16 rows, tl.dot's least), so that a key tile's scores are one matmul
for all of them, and the keys come a key tile at a time under an online softmax in
float32; the output is q's dtype. A second kernel merges each row's segments by their
log-sum-exps, in segment order. Sliding windows start a row's first segment at the tile
that holds its window's first key (the keys before it masked), and Gemma 2's soft-capping
applies to the scores before the mask. Attention sinks (gpt-oss: a logit per query head,
in the softmax's denominator, weighing no value) join a row where its segments are
merged, or, where a row has one segment, at the end of its segment's online softmax.

How a row's keys are cut. Key tiles lie at whole multiples of the tile size, so that a
tile sits inside one cache block or spans whole ones. A row's segment count comes from its
own visible tiles alone, in the kernel:

    segments = clamp(cdiv(tiles, MIN_SEGMENT_KEYS / tile), 1, MAX_SEGMENTS)

and its tiles are dealt out evenly, segment i taking tiles [i*tiles/segments,
(i+1)*tiles/segments). The grid is (rows, key/value heads, the most segments a row of the
tables' width can have): shapes only, so a CUDA graph captures it and replays it over any
contexts; a program past its row's own count returns at once. Where that most is one, the
first kernel writes the output itself and no merge is launched: the same bits as the merge
of one segment (weight 1, the float32 result unchanged, then rounded to q's dtype).

The constants, and why:
- MAX_SEGMENTS = 16, as vLLM's split for small decode batches: at batch 1 and 8 key/value
  heads a 2k context makes 128 programs, about one per SM of an H200 (132), and the merge
  reads a row's segments as one tile of 16.
- MIN_SEGMENT_KEYS = 128, FlashInfer's least chunk: a segment writes one float32 row per
  query head and the merge reads it back, 2 * group / keys of the K/V bytes it stands
  for: 6% at 128 keys and a group of 4 (12% at 64 keys). Small batches want more segments
  and large ones fewer, but a row's count may not depend on its batch (its bits would),
  so the least is set where a large batch pays little: 1k contexts split 8 ways (64
  programs at batch 1), 2k and longer 16.
- The key tile: 128 keys up to head_dim 64, 64 up to 128, 32 at 256 (each K and V tile at
  most 8192 elements, 16 KB in bfloat16, so a tile stays in registers with 4 warps); fewer
  where the block size is not a power of two, down to its largest power-of-two factor
  (a tile must lie inside one block, or span whole ones). 128 keys halve the serial steps
  of a head_dim-64 segment and double the bytes each step has in flight.
- Block ids: one per block a tile spans (one scalar where a block holds the whole tile),
  loaded a tile ahead, so that a tile's gathers never wait on its own table load.
- WARPS = 4 and STAGES = 2 for the attention kernel: two stages let Triton's pipeliner
  issue the next tile's K/V loads while this one computes, where it pipelines these
  gathers (their addresses are known a step ahead, from the prefetched block ids); a
  128-key tile's K and V take 32 KB of shared memory a stage, so 3 stages would cut the
  programs an SM holds. MERGE_WARPS = 2 for the merge, whose tile is 16 x head_dim.
Still to tune on the H200 (any of it may change a row's bits, never their invariance):
MIN_SEGMENT_KEYS 64/128/256 and the key tile at B=1, 64 and 128 over 1k and 8k contexts;
STAGES 2 or 3 and WARPS 4 or 8 for 128-key tiles, and whether the gathers pipeline at
all (the compiled kernel's cp.async); whether the merge should rather be done by each
row's last segment to finish (one launch fewer, a counter per row).

A row's bits depend on its query and its context alone: not on the batch, nor on the table
width (the segments are counted from the row's own tiles, the merge reads its 16 slots in
one fixed reduction), provided the layer, head_dim and block size are fixed, as they are
within a model. The prefill kernel's rows are invariant too (triton_varlen), but the
backend does not claim `row_invariant`: the chooser holds an invariant backend's prefill
rows to its decode rows, bit for bit, and the prefill walks a query's keys in one online
softmax where the decode kernel splits a row's keys into segments by its context and
merges them. To match, the prefill would have to split each query's keys as the decode
kernel splits that query's row, and merge: a query tile's rows have different contexts,
so different splits.

Every launch is sized by tensor shapes, never by their values: no host synchronisation, so
a CUDA graph captures it. Triton is imported with this module, which gpu_worker.kernels
imports only on CUDA: the CPU worker runs without it. TRITON_INTERPRET=1 runs the kernels
on a CPU (tests/test_worker_triton_attention.py, tests/test_worker_triton_varlen.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    CapturedStep,
    DecodeGroup,
    PrefillChunk,
)
from gpu_worker.attention.triton_tiles import (
    INTERPRETED,
    checked_key_tile,
    dim_pad,
    dot_precision,
    join_sink,
    key_tile,
    tanh,
    tile_blocks,
)
from gpu_worker.attention.triton_varlen import Chunks, chunks_on, paged_prefill
from gpu_worker.kv_cache import LayerKV

MAX_SEGMENTS = 16  # a power of two: the merge reads them as one tile
MIN_SEGMENT_KEYS = 128
WARPS, STAGES, MERGE_WARPS = 4, 2, 2


class TritonAttention(AttentionBackend):
    name = "triton"
    row_invariant = False  # its decode is, and its prefill; but not each other's (see the module)
    windows = True
    softcap = True
    sinks = True  # eagerly (attend_sinks): a model with sinks is never captured
    # Its grid and partial results are sized by the tables' width (a row's own context
    # alone sets what it reads): graphs are captured per width bucket (gpu_worker.graphs).
    any_width = False
    captures_steps = True

    def compiles(self, device: torch.device) -> bool:
        """On CUDA: each kernel variant (one segment or more, window, soft-capping, GQA
        group, head_dim) at its first launch."""
        return device.type == "cuda"

    def prefill_step(self, chunks: list[PrefillChunk], cache_like: torch.Tensor) -> Chunks:
        """The step's chunks as one launch: their rows in the step's q, their positions and
        their tables, stacked."""
        return chunks_on(
            cache_like.device,
            [chunk.rows.start for chunk in chunks],
            [chunk.context_len - chunk.start for chunk in chunks],
            [chunk.start for chunk in chunks],
            torch.stack([chunk.block_table for chunk in chunks]),
        )

    def prefill_all(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """One launch for every chunk of the step (their layer is the step's records')."""
        _refuse_codes(kv)
        paged_prefill(q, kv.k, kv.v, meta.prepared, meta.prefills[0].layer, out)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        """One chunk alone (the kernel chooser's check): a launch of its own, its records
        built here. The chunk's own K/V are read back from the cache, where they already
        are."""
        _refuse_codes(kv)
        count = chunk.context_len - chunk.start
        chunks = chunks_on(q.device, [0], [count], [chunk.start], chunk.block_table[None])
        out = q.new_empty(q.shape)
        paged_prefill(q, kv.k, kv.v, chunks, chunk.layer, out)
        return out

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        _refuse_codes(kv)
        return paged_decode(q, kv.k, kv.v, group)

    def attend_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        """As paged_attention's eager step, each row's softmax with its head's sink: the
        step's chunks in one launch, then its decode rows."""
        _refuse_codes(kv)
        out = q.new_empty(q.shape)
        if meta.prefills:
            paged_prefill(q, kv.k, kv.v, meta.prepared, meta.prefills[0].layer, out, sinks)
        group = meta.decode
        if group is not None:
            out[group.rows] = paged_decode(q[group.rows], kv.k, kv.v, group, sinks)
        return out

    def decode_sinks(
        self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup, sinks: torch.Tensor
    ) -> torch.Tensor:
        _refuse_codes(kv)
        return paged_decode(q, kv.k, kv.v, group, sinks)

    def prefill_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        chunk: PrefillChunk,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        """One chunk alone, with sinks (the kernel chooser's check), as `prefill`."""
        _refuse_codes(kv)
        count = chunk.context_len - chunk.start
        chunks = chunks_on(q.device, [0], [count], [chunk.start], chunk.block_table[None])
        out = q.new_empty(q.shape)
        paged_prefill(q, kv.k, kv.v, chunks, chunk.layer, out, sinks)
        return out

    def chunk_slots(
        self, cu_q: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor
    ) -> Chunks:
        return Chunks(cu_q, rows, starts, tables)

    def attend_captured(
        self, q: torch.Tensor, kv: LayerKV, step: CapturedStep, out: torch.Tensor
    ) -> None:
        """The chunk slots in one launch (an empty slot's programs return at once), the
        decode slots in the decode kernel's, as a step's own rows are attended eagerly:
        the same kernels, so the same bits."""
        _refuse_codes(kv)
        tokens, layer = q.shape[0], step.decode.layer
        paged_prefill(q, kv.k, kv.v, step.chunks, layer, out[:tokens])
        decoded = paged_decode(q.index_select(0, step.gather), kv.k, kv.v, step.decode)
        out.index_copy_(0, step.scatter, decoded)


def _refuse_codes(kv: LayerKV) -> None:
    if kv.quantized:
        raise RuntimeError("TritonAttention reads a cache of the model's dtype, not 8-bit codes")


@dataclass(slots=True, frozen=True)
class Split:
    """How one launch cuts its rows' keys, from shapes and the layer alone."""

    key_tile: int  # keys per loop step
    min_tiles: int  # a segment's least tiles (MIN_SEGMENT_KEYS), but for a row's last
    segments: int  # the grid's segments per (row, key/value head): the most a row can have


def split_for(width: int, block_size: int, head_dim: int, window: int | None) -> Split:
    """The split of a launch over tables `width` blocks wide: a row there has at most
    width * block_size keys (and a window's worth of them, over one more tile)."""
    tile = key_tile(block_size, head_dim)
    tiles = -(-width * block_size // tile)
    if window is not None:
        tiles = min(tiles, 1 + -(-(window - 1) // tile))
    min_tiles = max(1, MIN_SEGMENT_KEYS // tile)
    return Split(tile, min_tiles, max(1, min(MAX_SEGMENTS, -(-tiles // min_tiles))))


def paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: DecodeGroup,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, heads, d] over caches k, v [kv_heads, blocks, block_size, d] -> [B, heads, d];
    `sinks` [heads]: the layer's attention sinks, where it has them."""
    batch, heads, head_dim = q.shape
    block_size = k.shape[2]
    checked_key_tile(block_size, head_dim)
    # Sized by the table's width (a shape), so that a graph's launches fit every context.
    split = split_for(group.block_tables.shape[1], block_size, head_dim, group.layer.window)
    if q.stride(2) != 1:  # the kernel steps through a query's dims one element at a time
        q = q.contiguous()
    out = q.new_empty(q.shape)
    if batch == 0:
        return out
    if split.segments == 1:  # [B, heads, 1, d] is out's own layout: the result is final
        _attend(q, k, v, group, split, out, out, sinks)
        return out
    partial = q.new_empty((batch, heads, split.segments, head_dim), dtype=torch.float32)
    lse = partial.new_empty((batch, heads, split.segments))
    _attend(q, k, v, group, split, partial, lse, None)  # the merge adds the sinks
    _merge_kernel[(batch, heads)](
        partial,
        lse,
        group.context_lens,
        sinks,
        out,
        split.segments,
        group.layer.window or 0,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad(head_dim),
        KEY_TILE=split.key_tile,
        MIN_TILES=split.min_tiles,
        MAX_SEGMENTS=MAX_SEGMENTS,
        WINDOWED=group.layer.window is not None,
        SINKS=sinks is not None,
        num_warps=MERGE_WARPS,
    )
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: DecodeGroup,
    split: Split,
    partial: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
) -> None:
    """Launches one program per (row, key/value head, segment); `partial` and `lse` are
    contiguous [B, heads, segments, d] and [B, heads, segments]; `sinks` [heads] join the
    rows of a one-segment launch (DIRECT), whose output is final."""
    head_dim, kv_heads, block_size, layer = q.shape[2], k.shape[0], k.shape[2], group.layer
    tables = group.block_tables.contiguous()  # itself, as the worker builds them
    _segment_kernel[(q.shape[0], kv_heads, split.segments)](
        q,
        k,
        v,
        tables,
        group.context_lens,
        sinks,
        partial,
        lse,
        *q.stride()[:2],
        *k.stride(),
        *v.stride(),
        tables.stride(0),
        layer.scale_for(head_dim),
        layer.softcap or 1.0,
        layer.window or 0,
        GROUP=q.shape[1] // kv_heads,
        GROUP_PAD=max(16, triton.next_power_of_2(q.shape[1] // kv_heads)),  # tl.dot's least
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad(head_dim),
        BLOCK_SIZE=block_size,
        KEY_TILE=split.key_tile,
        BLOCKS_PER_TILE=max(1, split.key_tile // block_size),
        MIN_TILES=split.min_tiles,
        MAX_SEGMENTS=MAX_SEGMENTS,
        WINDOWED=layer.window is not None,
        SOFTCAP=layer.softcap is not None,
        SINKS=sinks is not None,
        DIRECT=split.segments == 1,
        PRECISION=dot_precision(q.dtype),
        UPCAST=INTERPRETED,
        num_warps=WARPS,
        num_stages=STAGES,
    )


@triton.jit
def _row_tiles(
    ctx,
    window,
    KEY_TILE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_SEGMENTS: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """A row's first visible key, its first tile, its count of tiles holding visible keys,
    and its count of segments: from its context length alone."""
    first = ctx * 0  # p - window < key <= p for the query at p = ctx - 1
    if WINDOWED:
        first = tl.maximum(ctx - window, 0)
    first_tile = first // KEY_TILE
    # (Not tl.cdiv: every call of a jit function costs Triton's interpreter ~2 ms.)
    tiles = (ctx + KEY_TILE - 1) // KEY_TILE - first_tile
    segments = tl.minimum(tl.maximum((tiles + MIN_TILES - 1) // MIN_TILES, 1), MAX_SEGMENTS)
    return first, first_tile, tiles, segments


@triton.jit(do_not_specialize=["stride_tb"])  # the table width varies step to step
def _segment_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    sinks_ptr,
    out_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
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
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_SEGMENTS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Attention of one row's GROUP query heads of one key/value head over one segment of
    its keys -> their output, normalised (DIRECT: in q's dtype, the final one), and the
    log2-sum-exp2 of their scores (scaled by log2 e). SINKS (one segment only): each query
    head's sink joins its softmax."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    segment = tl.program_id(2)
    ctx = tl.load(lens_ptr + row).to(tl.int64)
    first, first_tile, tiles, segments = _row_tiles(
        ctx, window, KEY_TILE, MIN_TILES, MAX_SEGMENTS, WINDOWED
    )
    if segment >= segments:  # past the row's own segments: the merge reads none such
        return
    # Tiles dealt out evenly: every segment holds one at least (segments <= tiles), but
    # an empty context's one segment, which writes 0.
    lo = first_tile + segment * tiles // segments
    hi = first_tile + (segment + 1) * tiles // segments
    end_block = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    dims = tl.arange(0, DIM_PAD)
    head_ok = g < GROUP
    dim_ok = dims < HEAD_DIM
    q_rows = q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_rows, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    table = tables_ptr + row * stride_tb

    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    blocks = tile_blocks(table, lo, end_block, BLOCK_SIZE, KEY_TILE, BLOCKS_PER_TILE)
    # Every tile holds a visible key, so `top` is finite after the first one.
    for tile in range(lo, hi):
        # The next tile's blocks, a step ahead: this tile's gathers do not wait on them.
        next_blocks = tile_blocks(table, tile + 1, end_block, BLOCK_SIZE, KEY_TILE, BLOCKS_PER_TILE)
        keys = tile * KEY_TILE + tl.arange(0, KEY_TILE)
        slots = keys % BLOCK_SIZE
        seen = keys < ctx  # no key outside the context or window is read
        if WINDOWED:
            seen = seen & (keys >= first)
        kt = tl.load(
            k_head + (blocks * stride_kb + slots * stride_ks)[None, :] + dims[:, None] * stride_kd,
            mask=seen[None, :] & dim_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        scores = tl.dot(q, kt, input_precision=PRECISION) * scale  # [GROUP_PAD, KEY_TILE]
        if SOFTCAP:  # Gemma 2's cap * tanh(score / cap), before the mask
            scores = softcap * tanh(scores / softcap)
        scores = tl.where(seen[None, :], scores * 1.4426950408889634, float("-inf"))  # log2(e)
        new_top = tl.maximum(top, tl.max(scores, 1))
        fade = tl.exp2(top - new_top)
        probs = tl.exp2(scores - new_top[:, None])
        total = total * fade + tl.sum(probs, 1)
        vt = tl.load(
            v_head + (blocks * stride_vb + slots * stride_vs)[:, None] + dims[None, :] * stride_vd,
            mask=seen[:, None] & dim_ok[None, :],
            other=0.0,
        )
        probs = probs.to(v_ptr.dtype.element_ty)  # the cache's dtype, as the MMA takes it
        if UPCAST:
            vt = vt.to(tl.float32)
            probs = probs.to(tl.float32)
        acc = acc * fade[:, None] + tl.dot(probs, vt, input_precision=PRECISION)
        top = new_top
        blocks = next_blocks

    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=float("-inf")).to(tl.float32)
        total, acc = join_sink(top, total, acc, sink * 1.4426950408889634)
    total = tl.where(total == 0.0, 1.0, total)  # no key: an empty context's output is 0
    result = acc / total[:, None]
    # Row-major [B, heads, segments(, d)]: with one segment, the output's own layout.
    at = (row * GROUP * tl.num_programs(1) + heads) * tl.num_programs(2) + segment
    out_ok = head_ok[:, None] & dim_ok[None, :]
    out_rows = out_ptr + at[:, None] * HEAD_DIM + dims[None, :]
    if DIRECT:
        tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(out_rows, result, mask=out_ok)
        tl.store(lse_ptr + at, top + tl.log2(total), mask=head_ok)


@triton.jit(do_not_specialize=["segments"])  # the grid's segments vary with the width
def _merge_kernel(
    partial_ptr,
    lse_ptr,
    lens_ptr,
    sinks_ptr,
    out_ptr,
    segments,
    window,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    KEY_TILE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MAX_SEGMENTS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One (row, head)'s segments -> its output: each weighted by its share of the
    softmax's denominator, 2 ** (lse - max lse) over their sum, as one tile of
    MAX_SEGMENTS slots (those past the row's count weigh 0), so one fixed order. SINKS:
    the head's sink joins the maximum and, last, the denominator, weighing no value."""
    row = tl.program_id(0).to(tl.int64)
    flat = row * tl.num_programs(1) + tl.program_id(1)  # its place in [B, heads]
    ctx = tl.load(lens_ptr + row).to(tl.int64)
    _, _, _, count = _row_tiles(ctx, window, KEY_TILE, MIN_TILES, MAX_SEGMENTS, WINDOWED)
    slots = tl.arange(0, MAX_SEGMENTS)
    ok = slots < count
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    at = flat * segments + slots
    lse = tl.load(lse_ptr + at, mask=ok, other=float("-inf"))
    top = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + tl.program_id(1)).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty context: every weight 0
    weights = tl.exp2(lse - top)
    values = tl.load(
        partial_ptr + at[:, None] * HEAD_DIM + dims[None, :],
        mask=ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    if SINKS:
        total += tl.exp2(sink - top)
    result = tl.sum(weights[:, None] * values, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + flat * HEAD_DIM + dims, result.to(out_ptr.dtype.element_ty), mask=dim_ok)
