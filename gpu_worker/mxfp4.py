"""MXFP4 weights (gpt-oss's experts), dequantized as the checkpoint is read.

A checkpoint stores such a weight W as `W_blocks` (uint8 [..., rows, groups, 16]: two 4-bit
E2M1 values a byte, the low nibble first, 32 values a group) and `W_scales` (uint8
[..., rows, groups]: a power of two per group, biased by 127). Each value is exactly
representable in float32 and bfloat16, so dequantizing is exact in either. The weight
comes out in the layout transformers' dense model declares (the stored one with its last
two axes swapped), as transformers' own convert_moe_packed_tensors gives it.
For now cadence serves the dequantized weights: four times the memory of the stored ones.
"""

from __future__ import annotations

import torch

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
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, not {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = table[codes].flatten(-2)  # [..., rows, groups, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    weight = torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)  # [..., rows, cols]
    return weight.transpose(-1, -2).to(dtype).contiguous()


def dequantize_all(stored: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The dense weights of `stored` pairs of NAME_blocks and NAME_scales, by NAME."""
    names = [n.removesuffix(BLOCKS) for n in stored if n.endswith(BLOCKS)]
    names = [n for n in names if n + SCALES in stored]
    unpaired = set(stored) - {n + suffix for n in names for suffix in (BLOCKS, SCALES)}
    if unpaired:
        raise ValueError(f"MXFP4 tensors without their pair: {', '.join(sorted(unpaired))}")
    return {name: dequantize(stored[name + BLOCKS], stored[name + SCALES], dtype) for name in names}
