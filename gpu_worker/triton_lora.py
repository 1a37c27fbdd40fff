"""The LoRA delta on CUDA (gpu_worker.lora): two Triton kernels over a step's adapted
tokens, each token reading its own slot's buffers, as vLLM's punica kernels (bgmv).

- `lora_shrink`: shrunk[n] = x[tokens[n]] @ A[slots[n]]^T, [N, max_rank] in float32. One
  program per (token, block of rank), summing over `in` in blocks.
- `lora_expand`: out[tokens[n], column:column + out_b] += (shrunk[n] @ B[slots[n]]^T) *
  scale[slots[n]], the delta rounded to out's dtype before the add (as the CPU path
  rounds it). One program per (token, block of outputs): each writes its own row's own
  columns, so no two programs touch one value.

A slot's ranks beyond its adapter's are zeros in A and B, so the padded sums add exact
zeros. Each token's result depends on its own row alone: a row's bits never depend on
its batch. Triton is imported with this module, which gpu_worker.lora imports on CUDA
only; TRITON_INTERPRET=1 runs the kernels on a CPU (tests/test_worker_lora.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_IN = 64
BLOCK_OUT = 64


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    tokens_ptr,
    slots_ptr,
    shrunk_ptr,
    inp,
    rank,
    x_stride,
    a_slot_stride,
    a_rank_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0)
    token = tl.load(tokens_ptr + n)
    slot = tl.load(slots_ptr + n)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, inp, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * x_stride + k, mask=k < inp, other=0.0).to(tl.float32)
        a_offsets = slot * a_slot_stride + r[:, None] * a_rank_stride + k[None, :]
        a_mask = (r[:, None] < rank) & (k[None, :] < inp)
        a = tl.load(a_ptr + a_offsets, mask=a_mask, other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(shrunk_ptr + n * rank + r, acc, mask=r < rank)


@triton.jit
def _expand_kernel(
    shrunk_ptr,
    b_ptr,
    scale_ptr,
    tokens_ptr,
    slots_ptr,
    out_ptr,
    out_b,
    rank,
    column,
    out_stride,
    b_slot_stride,
    b_out_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    n = tl.program_id(0)
    block = tl.program_id(1)
    token = tl.load(tokens_ptr + n)
    slot = tl.load(slots_ptr + n)
    r = tl.arange(0, BLOCK_R)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(shrunk_ptr + n * rank + r, mask=r < rank, other=0.0)
    b_offsets = slot * b_slot_stride + cols[:, None] * b_out_stride + r[None, :]
    b_mask = (cols[:, None] < out_b) & (r[None, :] < rank)
    b = tl.load(b_ptr + b_offsets, mask=b_mask, other=0.0).to(tl.float32)
    delta = tl.sum(b * s[None, :], axis=1) * tl.load(scale_ptr + slot)
    out_offsets = token * out_stride + column + cols
    base = tl.load(out_ptr + out_offsets, mask=cols < out_b, other=0.0)
    rounded = delta.to(out_ptr.dtype.element_ty).to(tl.float32)
    total = (base.to(tl.float32) + rounded).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_offsets, total, mask=cols < out_b)


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """x [T, in] (rows contiguous), A [slots, R, in] -> [N, R] float32."""
    n, rank, inp = tokens.shape[0], a.shape[1], a.shape[2]
    shrunk = torch.empty((n, rank), dtype=torch.float32, device=x.device)
    if n:
        _shrink_kernel[(n,)](
            x,
            a,
            tokens,
            slots,
            shrunk,
            inp,
            rank,
            x.stride(0),
            a.stride(0),
            a.stride(1),
            BLOCK_R=triton.next_power_of_2(rank),
            BLOCK_K=BLOCK_IN,
            enable_fp_fusion=False,
        )
    return shrunk


def lora_expand(
    shrunk: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    column: int,
) -> None:
    """out[tokens, column : column + out_b] += (shrunk @ B[slot]^T) * scale[slot], in
    place; B [slots, out_b, R]."""
    n, out_b, rank = tokens.shape[0], b.shape[1], b.shape[2]
    if not n:
        return
    grid = (n, triton.cdiv(out_b, BLOCK_OUT))
    _expand_kernel[grid](
        shrunk,
        b,
        scales,
        tokens,
        slots,
        out,
        out_b,
        rank,
        column,
        out.stride(0),
        b.stride(0),
        b.stride(1),
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_N=BLOCK_OUT,
        enable_fp_fusion=False,
    )
