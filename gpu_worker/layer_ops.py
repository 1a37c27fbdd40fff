"""The small operations between the matmuls, in four implementations.

- `TorchLayerOps`: PyTorch ops on any device (CUDA graphs capture them). These are the
  reference: each follows transformers' rounding step by step.
- `CompiledLayerOps`: the same functions compiled (Inductor, on CUDA), each fused into one
  kernel where PyTorch launches 3-10: ~600 launches fewer per decode step of a 16-layer
  model, which even replayed from a graph take longer than a 1B model's weights to stream.
- `NativeLayerOps`: the fused C++ kernels of csrc/layer_ops.cpp, on CPUs where they
  build. One pass per operation instead of dozens of small kernels per layer.
- `TritonLayerOps` (gpu_worker.triton_layer_ops, CUDA where triton imports): cadence's own
  Triton kernels, one launch per operation (add and norm, RoPE and the cache write, SiLU
  and mul), rounding as the reference does; no compile at start beyond Triton's JIT.

All four have one interface, so the model's forward pass is written once:
    rms_norm(x, weight, eps) -> normed x
    add_rms_norm_(x, delta, weight, eps) -> normed x, after x += delta in place
    silu_and_mul(gate_up [T, 2I]) -> silu(gate) * up [T, I]
    rope_and_cache_(qkv, positions, cos, signed_sin, kv, slots, heads, kv_heads)
        rotates q and k inside qkv [T, (heads + 2 kv_heads) * d] in place and writes the
        new k and v rows to their slots of the layer's cache kv (quantized if it is 8-bit).
    top_k_ids(logits [S, vocab], k) -> [S, k] ids of each row's k largest logits, best
        first (which of equal logits is taken may differ between the two).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from gpu_worker.kv_cache import LayerKV
from gpu_worker.kv_quant import as_bytes, quantize_rows


class TorchLayerOps:
    name = "torch"

    def __init__(self) -> None:
        self.rms_norm = rms_norm
        self.add_rms_norm_ = add_rms_norm_
        self.silu_and_mul = silu_and_mul
        self._rotate_ = rotate_

    def compiles(self, device: torch.device) -> bool:
        """Whether it compiles per shape (the worker warms it up then: gpu_worker.warm_up)."""
        return False

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
        head_dim = kv.k.shape[3]
        rows = qkv.shape[0]
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
        self._rotate_(qk, positions, cos, signed_sin)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
        write_kv(kv, qk[:, heads:], v, slots)

    def top_k_ids(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        return logits.topk(k, dim=-1).indices


class CompiledLayerOps(TorchLayerOps):
    """TorchLayerOps' functions through torch.compile (`compiler`: its backend), lengths
    dynamic. The cache write stays eager: compiled, an in-place write into the whole cache
    is an input mutation that Inductor may copy back whole."""

    name = "compiled"

    def __init__(self, compiler: Any = "inductor") -> None:
        compile = functools.partial(torch.compile, backend=compiler, dynamic=True, fullgraph=True)
        self.rms_norm = compile(rms_norm)
        self.add_rms_norm_ = compile(add_rms_norm_)
        self.silu_and_mul = compile(silu_and_mul)
        self._rotate_ = compile(rotate_)

    def compiles(self, device: torch.device) -> bool:
        return True


class NativeLayerOps:
    name = "native"

    def __init__(self, kernels: Any) -> None:
        self.rms_norm = kernels.rms_norm
        self.add_rms_norm_ = kernels.add_rms_norm_
        self.silu_and_mul = kernels.silu_and_mul
        self._rope_and_cache_ = kernels.rope_and_cache_
        self.top_k_ids = kernels.top_k_indices

    def compiles(self, device: torch.device) -> bool:
        return False

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
        self._rope_and_cache_(
            qkv,
            positions,
            cos,
            signed_sin,
            kv.k,
            kv.v,
            slots,
            heads,
            kv_heads,
            kv.k_scales,
            kv.v_scales,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Exactly as transformers does it: normalise in float32, round to the model's dtype,
    # then scale. F.rms_norm rounds once at the end instead, and in bfloat16 that shift is
    # enough to change SmolLM2's first answer word.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return rms_norm(x.add_(delta), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_(
    qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> None:
    """Rotates q and k heads [T, heads, d] in place, in one go (broadcast over heads)."""
    qk.copy_(apply_rope(qk, cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1)))


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, exactly as transformers: scaled by (1 + w) in float32, then rounded.
    `weight` is 1 + w already, in float32 (the model adds the one at load)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def add_gemma_rms_norm_(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return gemma_rms_norm(x.add_(delta), weight, eps)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu(gate, tanh approximation) * up, as Gemma's MLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate_half convention: x * cos + rotate_half(x) * sin.

    rotate_half(x) = cat(-x2, x1) is roll(x) = cat(x2, x1) with its first half negated;
    `signed_sin` carries that sign (see rope.rope_tables), so one roll replaces a slice, a
    negation and a cat, with the same values bit for bit.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k/v [T, kv_heads, d] into their slots of the [kv_heads, blocks, block_size, d] caches."""
    kv_heads, head_dim = kv.k.shape[0], kv.k.shape[3]
    for cache, scales, rows in ((kv.k, kv.k_scales, k), (kv.v, kv.v_scales, v)):
        rows = rows.transpose(0, 1)
        if scales is not None:
            rows, row_scales = quantize_rows(rows, cache.dtype)
            scales.view(kv_heads, -1).index_copy_(1, slots, row_scales)
        # As bytes: PyTorch has no index_copy_ for fp8.
        cache, rows = (as_bytes(t) for t in (cache, rows))
        cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, rows)


LayerOps = TorchLayerOps | CompiledLayerOps | NativeLayerOps
