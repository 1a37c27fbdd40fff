"""MXFP4 weights (gpt-oss's experts): kept quantized on the CPU, dequantized elsewhere.

A checkpoint stores such a weight W as `W_blocks` (uint8 [..., rows, groups, 16]: two 4-bit
E2M1 values a byte, the low nibble first, 32 values a group) and `W_scales` (uint8
[..., rows, groups]: a power of two per group, biased by 127).

On the CPU each expert's weight becomes a QuantWeight of kind mxfp4 (quant_weights), served
by the quantized matmul (gpu_worker.quant) at 4.25 bits a weight, as llama.cpp and vLLM
serve gpt-oss. On CUDA (whose matmuls are not the CPU's kernel) the weights are dequantized
as the checkpoint is read: each value is exactly representable in float32 and bfloat16, so
dequantizing is exact in either, and the weight comes out in the layout transformers' dense
model declares (the stored one with its last two axes swapped), as transformers' own
convert_moe_packed_tensors gives it, at 3.8 times the stored bytes in bfloat16.
"""

from __future__ import annotations

import torch

from gpu_worker.quant import QuantWeight, e8m0_scales

BLOCKS, SCALES = "_blocks", "_scales"
# E2M1's sixteen codes
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., rows, groups, 16] and scales [..., rows, groups] -> [..., cols, rows]."""
    _check(blocks, scales)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = table[codes].flatten(-2)  # [..., rows, groups, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    weight = torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)  # [..., rows, cols]
    return weight.transpose(-1, -2).to(dtype).contiguous()


def quant_weights(blocks: torch.Tensor, scales: torch.Tensor) -> list[QuantWeight]:
    """blocks [experts, rows, groups, 16] and scales [experts, rows, groups] -> each
    expert's [rows, cols] weight (a Linear's layout: the stored one), its codes unpacked
    one a byte (pack() packs them again, two a byte)."""
    _check(blocks, scales)
    experts, rows = blocks.shape[:2]
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # low nibble first
    codes = codes.view(experts, rows, -1)
    group = 2 * blocks.shape[-1]
    return [
        QuantWeight("mxfp4", codes[e], e8m0_scales(scales[e]), None, group) for e in range(experts)
    ]


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, not {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )


def pairs(stored: dict[str, torch.Tensor]) -> list[str]:
    """The NAMEs of `stored`'s pairs of NAME_blocks and NAME_scales; ValueError for a half
    pair."""
    names = [n.removesuffix(BLOCKS) for n in stored if n.endswith(BLOCKS)]
    names = [n for n in names if n + SCALES in stored]
    unpaired = set(stored) - {n + suffix for n in names for suffix in (BLOCKS, SCALES)}
    if unpaired:
        raise ValueError(f"MXFP4 tensors without their pair: {', '.join(sorted(unpaired))}")
    return names


def dequantize_all(stored: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The dense weights of `stored` pairs of NAME_blocks and NAME_scales, by NAME."""
    names = pairs(stored)
    return {name: dequantize(stored[name + BLOCKS], stored[name + SCALES], dtype) for name in names}
