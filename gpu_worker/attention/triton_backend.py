"""TritonAttention: cadence's own paged decode kernel, written in Triton, offered on CUDA
beside FlexAttention.

A decode step is one query per row, so its cost is reading each row's K/V; the kernel reads
them in place through the block tables, each byte once. One program takes a (row, key/value
head, partition of the row's keys): the query heads that share the key/value head come in
as one tile (padded to 16 rows, tl.dot's least), so that a key tile's scores are one matmul
for all of them, and the keys come KEY_TILE at a time, from as many cache blocks as that
spans (each key finds its block in the table), under an online softmax in float32; the
output is q's dtype. Partitions of PARTITION keys let a long context over a small batch
fill the GPU (split-KV, as vLLM's paged attention v2 and SGLang's decode kernels); a second
kernel merges each row's partitions by their log-sum-exps, in order. Where the tables are
one partition wide the first kernel writes the output itself: the same bits as that merge
of one partition. Sliding windows start a row's partitions at its window's first key, and
Gemma 2's soft-capping applies to the scores before the mask.

A row's bits depend on its query and its context alone: not on the batch, nor on the table
width (partitions are counted from the row's first visible key, the merge runs in a fixed
order). The backend still does not claim `row_invariant`: its prefill is FlexAttention's,
which does not reproduce these decode bits, and the chooser holds an invariant backend's
prefill rows to its decode rows.

Every launch is sized by tensor shapes, never by their values: no host synchronisation, so
a CUDA graph captures it. Triton is imported with this module, which gpu_worker.kernels
imports only on CUDA: the CPU worker runs without it. TRITON_INTERPRET=1 runs the kernels
on a CPU (tests/test_worker_triton_attention.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu_worker.attention.base import AttentionBackend, DecodeGroup, PrefillChunk
from gpu_worker.attention.flex_backend import FlexAttention
from gpu_worker.kv_cache import LayerKV

KEY_TILE = 64  # keys per loop iteration, whatever the block size (half past head_dim 128)
PARTITION = 512  # keys per program (a multiple of KEY_TILE)
MERGE_TILE = 16  # partitions the merge reads per iteration; fixed, so its order is too
# Triton's CPU interpreter multiplies a bfloat16 dot's raw bits (3.8): there the operands
# go up to float32 first, which gives the same products (a bfloat16 product is exact in it).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class TritonAttention(AttentionBackend):
    name = "triton"
    row_invariant = False  # its decode is; its prefill is FlexAttention's (see the module)
    windows = True
    softcap = True
    # Its grid and partial results are sized by the tables' width (a row's own context
    # alone sets what it reads): graphs are captured per width bucket (gpu_worker.graphs).
    any_width = False

    def __init__(self) -> None:
        self._prefiller = FlexAttention()

    def compiles(self, device: torch.device) -> bool:
        """On CUDA: FlexAttention's prefill per shape class, and each kernel variant (one
        partition or more, window, soft-capping) at its first launch."""
        return device.type == "cuda"

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        return self._prefiller.prefill_chunk(chunk, table, cache_like)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        return self._prefiller.prefill(q, k, v, kv, chunk)

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        if kv.quantized:
            raise RuntimeError(
                "TritonAttention reads a cache of the model's dtype, not 8-bit codes"
            )
        return paged_decode(q, kv.k, kv.v, group)


def paged_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    """q [B, heads, d] over caches k, v [kv_heads, blocks, block_size, d] -> [B, heads, d]."""
    batch, heads, head_dim = q.shape
    # Sized by the table's width (a shape), so that a graph's launches fit every context.
    span = group.block_tables.shape[1] * k.shape[2]
    if group.layer.window is not None:
        span = min(span, group.layer.window)
    parts = max(1, -(-span // PARTITION))
    if q.stride(2) != 1:  # the kernel steps through a query's dims one element at a time
        q = q.contiguous()
    out = q.new_empty(q.shape)
    if batch == 0:
        return out
    if parts == 1:  # [B, heads, 1, d] is out's own layout: the partition's result is final
        _attend(q, k, v, group, out, out, 1)
        return out
    partial = q.new_empty((batch, heads, parts, head_dim), dtype=torch.float32)
    lse = partial.new_empty((batch, heads, parts))
    _attend(q, k, v, group, partial, lse, parts)
    _merge_kernel[(batch, heads)](
        partial,
        lse,
        group.context_lens,
        out,
        parts,
        group.layer.window or 0,
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        PARTITION=PARTITION,
        MERGE_TILE=MERGE_TILE,
        WINDOWED=group.layer.window is not None,
    )
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: DecodeGroup,
    partial: torch.Tensor,
    lse: torch.Tensor,
    parts: int,
) -> None:
    """Launches one program per (row, key/value head, partition); `partial` and `lse` are
    contiguous [B, heads, parts, d] and [B, heads, parts]."""
    head_dim, kv_heads, layer = q.shape[2], k.shape[0], group.layer
    tables = group.block_tables.contiguous()  # itself, as the worker builds them
    _partition_kernel[(q.shape[0], kv_heads, parts)](
        q,
        k,
        v,
        tables,
        group.context_lens,
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
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k.shape[2],
        KEY_TILE=KEY_TILE if head_dim <= 128 else KEY_TILE // 2,  # K and V tiles in registers
        PARTITION=PARTITION,
        WINDOWED=layer.window is not None,
        SOFTCAP=layer.softcap is not None,
        DIRECT=parts == 1,
        # float32 caches are checked to 1e-4: TF32's 10-bit mantissa misses that
        PRECISION="ieee" if q.dtype == torch.float32 or INTERPRETED else "tf32",
        UPCAST=INTERPRETED,
    )


@triton.jit
def _first_key(ctx, window, WINDOWED: tl.constexpr):
    """A row's first visible key position: 0, or its window's first (p - window < k <= p
    for the query at p = ctx - 1)."""
    first = ctx * 0
    if WINDOWED:
        first = tl.maximum(ctx - window, 0)
    return first


@triton.jit(do_not_specialize=["stride_tb"])  # the table width varies step to step
def _partition_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
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
    PARTITION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Attention of one row's GROUP query heads of one key/value head over one partition of
    its keys -> their output, normalised (DIRECT: in q's dtype, the final one), and the
    log2-sum-exp2 of their scores (scaled by log2 e)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + row).to(tl.int64)
    start = _first_key(ctx, window, WINDOWED) + part * PARTITION
    end = tl.minimum(start + PARTITION, ctx)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    dims = tl.arange(0, DIM_PAD)
    head_ok = g < GROUP
    dim_ok = dims < HEAD_DIM
    q_rows = q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_rows, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    table = tables_ptr + row * stride_tb

    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    # Every tile holds a visible key (its first), so `top` is finite after the first one.
    for first in range(start, end, KEY_TILE):
        keys = first + tl.arange(0, KEY_TILE)
        seen = keys < end
        # Table entries past the context are never read, nor the cache through them.
        block = tl.load(table + keys // BLOCK_SIZE, mask=seen, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        kt = tl.load(
            k_head + (block * stride_kb + slot * stride_ks)[None, :] + dims[:, None] * stride_kd,
            mask=seen[None, :] & dim_ok[:, None],
            other=0.0,
        )
        scores = _dot(q, kt, PRECISION, UPCAST) * scale  # [GROUP_PAD, KEY_TILE]
        if SOFTCAP:  # Gemma 2's cap * tanh(score / cap), before the mask
            scores = softcap * _tanh(scores / softcap)
        scores = tl.where(seen[None, :], scores * 1.4426950408889634, float("-inf"))  # log2(e)
        new_top = tl.maximum(top, tl.max(scores, 1))
        fade = tl.exp2(top - new_top)
        probs = tl.exp2(scores - new_top[:, None])
        total = total * fade + tl.sum(probs, 1)
        vt = tl.load(
            v_head + (block * stride_vb + slot * stride_vs)[:, None] + dims[None, :] * stride_vd,
            mask=seen[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * fade[:, None] + _dot(probs.to(vt.dtype), vt, PRECISION, UPCAST)
        top = new_top

    total = tl.where(total == 0.0, 1.0, total)  # no key: an empty context's output is 0
    result = acc / total[:, None]
    # Row-major [B, heads, parts(, d)]: with one partition, the output's own layout.
    at = (row * GROUP * tl.num_programs(1) + heads) * tl.num_programs(2) + part
    out_ok = head_ok[:, None] & dim_ok[None, :]
    out_rows = out_ptr + at[:, None] * HEAD_DIM + dims[None, :]
    if DIRECT:
        tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:  # a partition past a short row's keys writes nothing: the merge reads none such
        # (A block, not a scalar, beside the masks: Triton 3.9's interpreter refuses the
        # mask a block and a scalar make.)
        live = (start + tl.zeros_like(g)) < end
        tl.store(out_rows, result, mask=out_ok & live[:, None])
        tl.store(lse_ptr + at, top + tl.log2(total), mask=head_ok & live)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in float32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tanh(x):
    """tanh from exp2, which every Triton backend and the interpreter have alike."""
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    magnitude = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def _merge_kernel(
    partial_ptr,
    lse_ptr,
    lens_ptr,
    out_ptr,
    parts,
    window,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PARTITION: tl.constexpr,
    MERGE_TILE: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """One (row, head)'s partitions -> its output: each weighted by its share of the
    softmax's denominator, 2 ** (lse - max lse) over their sum, in partition order."""
    row = tl.program_id(0).to(tl.int64)
    flat = row * tl.num_programs(1) + tl.program_id(1)  # its place in [B, heads]
    ctx = tl.load(lens_ptr + row).to(tl.int64)
    count = tl.cdiv(ctx - _first_key(ctx, window, WINDOWED), PARTITION)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM

    top = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    # Each tile's first partition holds keys, so `top` is finite after the first one.
    for first in range(0, count, MERGE_TILE):
        at = flat * parts + first + tl.arange(0, MERGE_TILE)
        ok = first + tl.arange(0, MERGE_TILE) < count
        lse = tl.load(lse_ptr + at, mask=ok, other=float("-inf"))
        new_top = tl.maximum(top, tl.max(lse, 0))
        fade = tl.exp2(top - new_top)
        weights = tl.exp2(lse - new_top)
        values = tl.load(
            partial_ptr + at[:, None] * HEAD_DIM + dims[None, :],
            mask=ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * fade + tl.sum(weights[:, None] * values, 0)
        total = total * fade + tl.sum(weights, 0)
        top = new_top
    result = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + flat * HEAD_DIM + dims, result.to(out_ptr.dtype.element_ty), mask=dim_ok)
