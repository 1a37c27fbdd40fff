"""The 8-bit KV cache's quantization, in PyTorch: the reference the C++ kernels (csrc/kv_quant.h)
agree with bit for bit.

An 8-bit cache [kv_heads, blocks, block_size, d] of int8 or fp8 (e4m3) codes halves a bfloat16
cache's bytes: twice the tokens in the same memory, half the bytes a decode step streams. Each
row (token, kv head) has its own float32 scale, in scales [kv_heads, blocks, block_size], so an
outlier costs only its own row precision.

Attention sees a row as the model dtype's rounding of code * scale: an 8-bit cache is then
exactly a cache of the model dtype holding those values, and the attention kernels give it the
bits they give that cache.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}

# The largest code magnitude each cache dtype stores: a row's amax maps to it.
_CODE_LIMITS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether `cache` holds 8-bit codes, so that it needs its scales to be read."""
    return cache.dtype in _CODE_LIMITS


def quantize_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., d] of the model dtype -> (codes [..., d] of cache_dtype, scales [...] float32).

    scale = amax|x| / 127 (int8) or / 448 (fp8); codes are x / scale in float32, rounded half
    to even and clamped to +-127 (int8) or converted to fp8 (round to nearest even). A row
    whose scale is 0 is all zero codes: x / 0 would be NaN.
    """
    values = x.float()
    scales = values.abs().amax(dim=-1) / _CODE_LIMITS[cache_dtype]
    zero = (scales == 0).unsqueeze(-1)
    ratios = torch.where(zero, 0.0, values / torch.where(zero, 1.0, scales.unsqueeze(-1)))
    if cache_dtype == torch.int8:
        return torch.round(ratios).clamp(-127, 127).to(torch.int8), scales
    return ratios.to(cache_dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., d] and their scales [...] -> the values attention sees, (code * scale)
    in float32 rounded to the model dtype."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor seen as uint8 (PyTorch's CPU copies and gathers lack fp8); others as
    they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
