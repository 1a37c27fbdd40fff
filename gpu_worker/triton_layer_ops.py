"""TritonLayerOps: cadence's own kernels for the small operations between the matmuls, on
CUDA, one launch each where PyTorch launches 2-10.

Three kernels, each rounding where TorchLayerOps (the reference, which follows
transformers) rounds, in the same order:
- `_rms_norm_kernel`: one program per row. With a delta it adds it into the residual in
  place (rounded to the model's dtype, as `x.add_`), then normalises that row in float32,
  rounds to the model's dtype, and multiplies by the weight. Its float32 sum of squares
  runs in another order than PyTorch's, so a normed value may differ in the last bit; the
  residual update is exact.
- `_rope_and_cache_kernel`: one program per token, its heads the rows of a tile. The q
  and k heads are rotated in place by Hugging Face's rotate_half convention
  (x * cos + roll(x) * signed_sin, see layer_ops.apply_rope), each product and the sum
  rounded to the model's dtype as the three PyTorch ops round them; k and v are also
  written to the token's cache slot. The two halves of each head come in as two tiles of
  one layout, so every lane rewrites only the values it read itself: no lane overwrites
  what another has still to read. Exact.
- `_silu_and_mul_kernel`: silu(gate) = gate / (1 + exp(-gate)) in float32, rounded to the
  model's dtype (PyTorch computes it so), then times up, rounded. On CUDA the exp is
  libdevice's expf and the division correctly rounded, as in PyTorch's CUDA kernel; the
  interpreter has no libdevice, and its exp (numpy's) may differ from PyTorch's CPU one in
  float32's last bit, which rounding to bfloat16 almost always hides.

Each row's result depends on that row alone (a row per program, or elementwise), so a
row's bits never depend on its batch. Launches are sized by tensor shapes only, never by
values: no host synchronisation, so CUDA graphs capture them. Floating-point contraction
is off (LAUNCH_OPTIONS): a fused multiply-add would round once where PyTorch's separate
kernels round twice (in bfloat16 too, where the compiler would fuse a product rounded to
bfloat16 and the sum after it into one bfloat16 fma).

What stays on the PyTorch path: an 8-bit cache's write (the kernel rotates, then
layer_ops.write_kv quantizes and writes, several kernels); top_k_ids; Gemma's norms and
GeGLU, and Qwen3's q/k norms, which the model takes from gpu_worker.layer_ops directly
(gemma_rms_norm scales by 1 + w in float32 before rounding), never from the LayerOps.
Partial rotary embeddings never reach here: the model refuses such configs.

A slot outside the cache is not written (torch's index_copy_ would raise; a kernel cannot
without synchronising). Triton is imported with this module, which gpu_worker.kernels
imports only on CUDA: the CPU worker runs without it. TRITON_INTERPRET=1 runs the kernels
on a CPU (tests/test_worker_triton_layer_ops.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gpu_worker.kv_cache import LayerKV
from gpu_worker.layer_ops import TorchLayerOps, write_kv

# Triton's CPU interpreter has no libdevice (silu's exp is tl.exp there) and truncates
# float32 to bfloat16 (_round rounds by hand there).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SILU_TILE = 1024  # elements of a row per silu-and-mul program
# Every launch's: PyTorch rounds each product and each sum, so no fused multiply-adds.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


class TritonLayerOps(TorchLayerOps):
    """TorchLayerOps' interface (gpu_worker.layer_ops) through the kernels above; top_k_ids
    stays PyTorch's."""

    name = "triton"

    def __init__(self) -> None:
        self.rms_norm = rms_norm
        self.add_rms_norm_ = add_rms_norm_
        self.silu_and_mul = silu_and_mul

    def compiles(self, device: torch.device) -> bool:
        """On CUDA each kernel compiles at its first launch per dtype and shape class."""
        return device.type == "cuda"

    def rope_and_cache_(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv: LayerKV,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> None:
        rope_and_cache_(qkv, positions, cos, signed_sin, kv, slots, heads, kv_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)


def add_rms_norm_(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return _norm(x, delta, weight, eps)


def _norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x [..., n] (plus delta, into x in place) -> normed, of weight times x's dtype."""
    width = x.shape[-1]
    rows = x.view(-1, width)  # a view, so that the in-place add reaches x
    deltas = rows if delta is None else delta.reshape(-1, width)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0] == 0:
        return out
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        deltas,
        weight,
        out,
        rows.stride(0),
        deltas.stride(0),
        eps,
        WIDTH=width,
        BLOCK=block,
        ADD=delta is not None,
        INTERPRETED=INTERPRETED,
        num_warps=max(1, min(16, block // 256)),  # a few values a lane, whatever the width
        **LAUNCH_OPTIONS,
    )
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_delta,
    eps,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One row: (x += delta,) then weight * round(x / rms(x)) as TorchLayerOps.rms_norm."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < WIDTH
    x_row = x_ptr + row * stride_x + cols
    x = tl.load(x_row, mask=ok, other=0.0)
    if ADD:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0)
        x = _round(x.to(tl.float32) + delta.to(tl.float32), x_ptr.dtype.element_ty, INTERPRETED)
        tl.store(x_row, x, mask=ok)
    xf = x.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(xf * xf, 0) / WIDTH + eps)
    normed = _round(xf * inverse_rms, x_ptr.dtype.element_ty, INTERPRETED)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(
        out_ptr + row * WIDTH + cols, _round(out, out_ptr.dtype.element_ty, INTERPRETED), mask=ok
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = gate_up.new_empty((tokens, width))
    if tokens == 0:
        return out
    tile = min(SILU_TILE, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(tokens, triton.cdiv(width, tile))](
        gate_up,
        out,
        gate_up.stride(0),
        WIDTH=width,
        TILE=tile,
        INTERPRETED=INTERPRETED,
        num_warps=4,
        **LAUNCH_OPTIONS,
    )
    return out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_row,
    WIDTH: tl.constexpr,
    TILE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    ok = cols < WIDTH
    gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_row + WIDTH + cols, mask=ok, other=0.0)
    e = tl.exp(-gate) if INTERPRETED else libdevice.exp(-gate)
    # PyTorch's silu: x / (1 + exp(-x)) in float32, rounded; then the product, rounded.
    silu = _round(tl.math.div_rn(gate, 1.0 + e), out_ptr.dtype.element_ty, INTERPRETED)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(
        out_ptr + row * WIDTH + cols, _round(out, out_ptr.dtype.element_ty, INTERPRETED), mask=ok
    )


def rope_and_cache_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv: LayerKV,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> None:
    """Rotates q and k inside qkv [T, (heads + 2 kv_heads) * d] in place and writes k and v
    to their slots of kv ([kv_heads, blocks, block_size, d], last dimension contiguous)."""
    tokens, head_dim = qkv.shape[0], kv.k.shape[3]
    if tokens == 0:
        return
    write = not kv.quantized  # an 8-bit cache is written by write_kv, after the rotation
    k, v = kv.k, kv.v
    heads_pad = triton.next_power_of_2(heads + 2 * kv_heads)
    half_pad = triton.next_power_of_2(head_dim // 2)
    _rope_and_cache_kernel[(tokens,)](
        qkv,
        positions,
        cos,
        signed_sin,
        slots,
        k,
        v,
        qkv.stride(0),
        qkv.stride(1),
        cos.stride(0),
        signed_sin.stride(0),
        *k.stride()[:3],
        *v.stride()[:3],
        k.shape[1] * k.shape[2],
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEADS_PAD=heads_pad,
        HALF=head_dim // 2,
        HALF_PAD=half_pad,
        BLOCK_SIZE=k.shape[2],
        WRITE=write,
        INTERPRETED=INTERPRETED,
        num_warps=max(1, min(8, heads_pad * half_pad // 256)),  # a few pairs a lane
        **LAUNCH_OPTIONS,
    )
    if not write:
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
        v_rows = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        write_kv(kv, qk[:, heads:], v_rows, slots)


@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    k_ptr,
    v_ptr,
    stride_t,
    stride_e,
    stride_cos,
    stride_sin,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_vh,
    stride_vb,
    stride_vs,
    capacity,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WRITE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One token: its HEADS q heads, then KV_HEADS k heads, then KV_HEADS v heads, as the
    rows of a [heads, half a head] tile per half."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_PAD)[:, None]
    lane = tl.arange(0, HALF_PAD)[None, :]
    ok = (head < HEADS + 2 * KV_HEADS) & (lane < HALF)
    first = qkv_ptr + token * stride_t + (head * 2 * HALF + lane) * stride_e
    second = first + HALF * stride_e
    x1 = tl.load(first, mask=ok, other=0.0)
    x2 = tl.load(second, mask=ok, other=0.0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_row, sin_row = cos_ptr + position * stride_cos, sin_ptr + position * stride_sin
    dtype = qkv_ptr.dtype.element_ty
    y1, y2 = _rotated(x1, x2, cos_row, sin_row, lane, lane < HALF, dtype, HALF, INTERPRETED)
    rotated = ok & (head < HEADS + KV_HEADS)
    tl.store(first, y1, mask=rotated)
    tl.store(second, y2, mask=rotated)
    if WRITE:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        # A block beside the other masks, not a scalar: Triton 3.9's interpreter refuses
        # the mask a block and a scalar make.
        at = slot + tl.zeros_like(head)
        written = ok & (at >= 0) & (at < capacity)
        is_k = written & (head >= HEADS) & (head < HEADS + KV_HEADS)
        k_row = k_ptr + (head - HEADS) * stride_kh + block * stride_kb + offset * stride_ks
        tl.store(k_row + lane, y1, mask=is_k)
        tl.store(k_row + HALF + lane, y2, mask=is_k)
        is_v = written & (head >= HEADS + KV_HEADS)
        v_head = head - HEADS - KV_HEADS
        v_row = v_ptr + v_head * stride_vh + block * stride_vb + offset * stride_vs
        tl.store(v_row + lane, x1, mask=is_v)
        tl.store(v_row + HALF + lane, x2, mask=is_v)


@triton.jit
def _rotated(
    x1,
    x2,
    cos_row,
    sin_row,
    lanes,
    ok,
    dtype: tl.constexpr,
    HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Heads' halves rotated: x * cos + roll(x) * signed_sin, whose roll swaps the halves;
    each product and the sum rounded to `dtype` (qkv's), as PyTorch's three ops round."""
    c1 = tl.load(cos_row + lanes, mask=ok, other=0.0)
    c2 = tl.load(cos_row + HALF + lanes, mask=ok, other=0.0)
    s1 = tl.load(sin_row + lanes, mask=ok, other=0.0)
    s2 = tl.load(sin_row + HALF + lanes, mask=ok, other=0.0)
    y1 = _product(x1, c1, dtype, INTERPRETED) + _product(x2, s1, dtype, INTERPRETED)
    y2 = _product(x2, c2, dtype, INTERPRETED) + _product(x1, s2, dtype, INTERPRETED)
    return _round(y1, dtype, INTERPRETED), _round(y2, dtype, INTERPRETED)


@triton.jit
def _product(a, b, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """a * b rounded to `dtype`, as PyTorch multiplies two tensors of it; in float32."""
    return _round(a.to(tl.float32) * b.to(tl.float32), dtype, INTERPRETED).to(tl.float32)


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 x to `dtype`, to nearest even. Triton 3.9's interpreter truncates float32
    to bfloat16: there the rounding is done on the bits (x finite)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        rounded = x.to(dtype)
    return rounded
