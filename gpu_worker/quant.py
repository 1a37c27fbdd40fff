"""Weights kept quantized: their formats, the quantizers, and the matmul that serves them.

A decode step of a small model is memory-bound: it streams every weight once per step, so
a weight in 8 or 4 bits instead of 16 costs a half or a quarter of the time. Three formats
hold every weight cadence quantizes or takes from a GGUF file (gguf_quants maps each
llama.cpp block type onto one of them without loss), and a fourth gpt-oss's experts:
- q8: int8 values in groups of `group` (32, or 16 for Q6_K) along K, a float32 scale per
  group and optionally a float32 min: w = scale * value + min;
- q5: values 0..31 in groups of 32, a float32 scale and min per group (Q5_0, Q5_1, Q5_K);
- q4: values 0..15, likewise;
- mxfp4: E2M1 codes 0..15 in groups of 32 (gpu_worker.mxfp4), each standing for the
  integer MXFP4_VALUES[code] (llama.cpp's kvalues_mxfp4: E2M1's values doubled), and a
  power-of-two scale per group, 2^(e - 127) / 2 for the checkpoint's E8M0 byte e.

The matmul is llama.cpp's: each row of x is quantized per 32 values to int8 with a float32
scale, each group's dot product is exact integer arithmetic, and the groups' products are
summed in float32 in K order. Nothing of that depends on which rows share a call, so a
row's bits are independent of its batch and its chunk, as gpu_worker.linear promises for
the dense matmuls (QuantLinear still checks its call sizes the same way). The C++ kernel
(csrc/quant_matmul.cpp, AVX512-VNNI or AVX2) and reference_matmul below compute the same
bits; the reference is the slow correct path, used where the kernel is not built (neither,
no compiler, CUDA) and as the tests' oracle.

What is exact for mxfp4: its integer values and power-of-two scales are the dequantized
weights exactly, and a group's integer dot times its weight scale is exact in float32 (a
dot of at most 32 x 12 x 127 < 2^24 moved by a power of two; the subnormal scales of e < 2
included, all short of an overflow no checkpoint has). So each group's float32 term is the
exact product of the dequantized weights with the int8-quantized activations, rounded once
(by the activations' scale), and the terms are summed in float32 in K order: the matmul is
that of the dequantized weights up to the activations' quantization and float32's sum.
The other kinds' terms round twice (the code dot times a float scale, then times the
activations' scale), their mins' terms once more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gpu_worker.linear import ROW_SIZES, Linear, RowSizes, SizedCalls, agreeing_sizes

ACTIVATION_GROUP = 32  # activation values per int8 scale
BLOCK_COLUMNS = 16  # output columns per block of the packed layout
# llama.cpp's kvalues_mxfp4: E2M1's sixteen values (gpu_worker.mxfp4.FP4_VALUES) doubled
MXFP4_VALUES = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8
)
E8M0_NAN = 255  # the E8M0 byte that is no scale


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A [N, K] weight: w[n, k] = scales[n, k // group] * values[n, k] + mins[n, k // group]
    (no mins: 0). q8's values are int8; q5's uint8 in 0..31, q4's in 0..15; mxfp4's uint8
    codes 0..15 stand for MXFP4_VALUES[code] (integers()), its scales powers of two."""

    kind: str  # "q8" | "q5" | "q4" | "mxfp4"
    values: torch.Tensor  # [N, K]
    scales: torch.Tensor  # float32 [N, K // group]
    mins: torch.Tensor | None  # float32 [N, K // group]
    group: int

    def dequantize(self) -> torch.Tensor:
        """The weight in float32: the values a matmul with it stands for."""
        return _dequantized(self.integers().float(), self.scales, self.mins, self.group)

    def integers(self) -> torch.Tensor:
        """[N, K]: what each group's integer dot multiplies (mxfp4's codes decoded)."""
        return _integers(self.kind, self.values)

    def rows(self, start: int, stop: int) -> QuantWeight:
        """Output rows start..stop (a part of a fused weight)."""
        mins = None if self.mins is None else self.mins[start:stop]
        part = (self.values[start:stop], self.scales[start:stop], mins)
        return QuantWeight(self.kind, *part, self.group)

    def select(self, ids: torch.Tensor) -> QuantWeight:
        """Output rows `ids`, in their order (a copy)."""
        mins = None if self.mins is None else self.mins[ids]
        return QuantWeight(self.kind, self.values[ids], self.scales[ids], mins, self.group)

    def to(self, device: torch.device) -> QuantWeight:
        mins = None if self.mins is None else self.mins.to(device)
        values, scales = self.values.to(device), self.scales.to(device)
        return QuantWeight(self.kind, values, scales, mins, self.group)


def kind_of(values: torch.Tensor) -> str:
    """The narrowest format that holds these values as they are: int8 ones are q8, uint8
    ones q4 where they fit in four bits, else q5 (a GGUF conversion stores uint8 codes)."""
    if values.dtype == torch.int8:
        return "q8"
    top = int(values.max()) if values.numel() else 0
    if top > 31:
        raise ValueError(f"uint8 weight codes run to {top}; q5 holds 0..31")
    return "q4" if top <= 15 else "q5"


def _integers(kind: str, codes: torch.Tensor) -> torch.Tensor:
    if kind != "mxfp4":
        return codes
    return MXFP4_VALUES.to(codes.device)[codes.long()]


def e8m0_scales(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes e -> mxfp4's float32 scales 2^(e - 128): exact (e < 2 subnormal)."""
    if bool((exponents == E8M0_NAN).any()):
        raise ValueError("an MXFP4 scale is E8M0's NaN (255)")
    return torch.exp2(exponents.double() - 128).float()


def e8m0_exponents(scales: torch.Tensor) -> torch.Tensor:
    """mxfp4's float32 scales -> their E8M0 bytes (e8m0_scales undone)."""
    fractions, exponents = torch.frexp(scales.double())  # scale = 0.5 x 2^exponent
    e = exponents + 127
    if not (bool((fractions == 0.5).all()) and bool(((e >= 0) & (e < E8M0_NAN)).all())):
        raise ValueError("mxfp4 scales are powers of two from 2^-128 to 2^126")
    return e.to(torch.uint8)


def _dequantized(
    values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int
) -> torch.Tensor:
    w = values * scales.repeat_interleave(group, dim=-1)
    return w if mins is None else w + mins.repeat_interleave(group, dim=-1)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per 32 values, as llama.cpp's Q8_0 (but a float32 scale)."""
    groups = _grouped(weight, 32)
    scales = groups.abs().amax(-1) / 127
    inverse = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))
    values = torch.round(groups * inverse.unsqueeze(-1)).clamp(-127, 127)
    return QuantWeight("q8", values.flatten(1).to(torch.int8), scales, None, 32)


def quantize_int4(weight: torch.Tensor) -> QuantWeight:
    """Asymmetric 4 bits per 32 values, as llama.cpp's Q4_1 (but float32 scale and min)."""
    groups = _grouped(weight, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low) / 15
    inverse = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))
    values = torch.round((groups - low.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp(0, 15)
    return QuantWeight("q4", values.flatten(1).to(torch.uint8), scales, low, 32)


Quantizer = Callable[[torch.Tensor], QuantWeight]
QUANTIZERS: dict[str, Quantizer] = {"int8": quantize_int8, "int4": quantize_int4}


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    rows, k = weight.shape
    if k % group:
        raise ValueError(f"a weight of {k} columns does not split into groups of {group}")
    return weight.detach().float().reshape(rows, k // group, group)


# ---- the packed layout (csrc/quant_matmul.cpp) --------------------------------------------


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A QuantWeight in the kernel's layout: columns in blocks of 16, and within a block,
    per 4 values of K, the 16 columns' 4 values side by side (one 64-byte line feeds one
    vpdpbusd). q8 stores value + 128, 8 lines per 32 values; q4 (and mxfp4) puts lines c
    and c + 4 of each 32 values into one line's low and high nibbles, 4 lines; q5 adds to
    those a line of the values' fifth bits, a 64-bit mask per line of 64 values (bit j:
    byte j). scales, mins: [blocks, K // group, 16], float32; mxfp4's scales are E8M0
    bytes (4.25 bits a weight in all)."""

    kind: str
    n: int
    k: int
    group: int
    data: torch.Tensor  # uint8
    scales: torch.Tensor
    mins: torch.Tensor | None

    def unpack(self) -> QuantWeight:
        """The QuantWeight this was packed from (the rows beyond n dropped)."""
        blocks = self.scales.shape[0]
        lines = self._lines()
        codes = torch.cat(self._nibble_codes(lines), dim=2) if self.kind != "q8" else lines
        codes = codes.unflatten(-1, (BLOCK_COLUMNS, 4))  # [blocks, groups, 8, 16, 4]
        if self.kind == "q5":
            fifth = (lines[:, :, 4].unsqueeze(-1) >> _BIT_SHIFTS) & 1  # [.., 64 bytes, 8 bits]
            codes = codes | (fifth << 4).reshape(codes.shape)
        codes = codes.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK_COLUMNS, self.k)[: self.n]
        values = codes if self.kind != "q8" else (codes.to(torch.int16) - 128).to(torch.int8)
        scales, mins = _unblocked(self._float_scales(), self.n), _unblocked(self.mins, self.n)
        assert scales is not None
        return QuantWeight(self.kind, values, scales, mins, self.group)

    def _float_scales(self) -> torch.Tensor:
        return e8m0_scales(self.scales) if self.kind == "mxfp4" else self.scales

    def _lines(self) -> torch.Tensor:
        """The data as [blocks, K // 32, lines, 64]: 8 lines per 32 values (q8), 4 (q4), or
        4 and the line of fifth bits (q5); a view."""
        per_group = _BITS[self.kind]  # a 64-byte line per bit of 16 x 32 values, q8's too
        return self.data.view(self.scales.shape[0], self.k // 32, per_group, 64)

    @staticmethod
    def _nibble_codes(lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The low four bits of code lines 0..3 and 4..7 from a q4 or q5 group's lines."""
        nibbles = lines[..., :4, :]
        return nibbles & 0x0F, nibbles >> 4

    def matmul(self, native: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The C++ kernel: x [M, K] -> [M, n], in x's dtype."""
        if self.kind == "mxfp4":
            return native.mxfp4_matmul(x, self.data, self.scales, bias, self.n)
        return native.quant_matmul(
            x, self.data, self.scales, self.mins, bias, self.n, self.group, _BITS[self.kind]
        )

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Output rows `ids` ([...] int64) of the weight in float32: [..., K]."""
        blocks, column = ids // BLOCK_COLUMNS, ids % BLOCK_COLUMNS
        lines = self._lines().unflatten(-1, (BLOCK_COLUMNS, 4))  # [B, groups, lines, 16, 4]
        if self.kind == "q8":
            codes = lines[blocks, :, :, column].float() - 128  # [..., groups, 8, 4]
        else:
            low, high = self._nibble_codes(lines[blocks, :, :, column])
            codes = torch.cat((low, high), dim=-2)
            if self.kind == "q5":
                # mask c's bits 4 * column .. + 3: byte 8c + column // 2, from bit 4 * (column % 2)
                masks = self._lines()[:, :, 4].unflatten(-1, (8, 8))[blocks, :, :, column // 2]
                fields = masks >> (4 * (column % 2)).to(torch.uint8).view(*column.shape, 1, 1)
                codes = codes | (((fields.unsqueeze(-1) >> _BIT_SHIFTS[:4]) & 1) << 4)
            codes = _integers(self.kind, codes).float()
        mins = None if self.mins is None else self.mins[blocks, :, column]
        scales = self._float_scales()[blocks, :, column]
        return _dequantized(codes.flatten(-3), scales, mins, self.group)


_BITS = {"q8": 8, "q5": 5, "q4": 4, "mxfp4": 4}
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack(weight: QuantWeight) -> PackedWeight:
    n, k = weight.values.shape
    if k % ACTIVATION_GROUP:
        raise ValueError(f"a quantized weight needs K a multiple of 32, not {k}")
    blocks = -(-n // BLOCK_COLUMNS)
    codes = weight.values.to(torch.int16) + (128 if weight.kind == "q8" else 0)
    codes = F.pad(codes, (0, 0, 0, blocks * BLOCK_COLUMNS - n)).to(torch.uint8)
    lines = codes.view(blocks, BLOCK_COLUMNS, k // 32, 8, 4).permute(0, 2, 3, 1, 4)
    if weight.kind != "q8":
        nibbles = (lines[:, :, :4] & 0x0F) | ((lines[:, :, 4:] & 0x0F) << 4)
        parts = [nibbles.reshape(blocks, k // 32, 256)]
        if weight.kind == "q5":  # each line's 64 fifth bits, 8 to a byte, low bit first
            fifth = ((lines >> 4) & 1).reshape(blocks, k // 32, 64, 8)
            parts.append((fifth << _BIT_SHIFTS).sum(-1, dtype=torch.uint8))
        lines = torch.cat(parts, dim=-1)
    data = lines.contiguous().flatten()
    mins = None if weight.mins is None else _blocked(weight.mins.float(), blocks)
    scales = e8m0_exponents(weight.scales) if weight.kind == "mxfp4" else weight.scales.float()
    return PackedWeight(weight.kind, n, k, weight.group, data, _blocked(scales, blocks), mins)


def _blocked(params: torch.Tensor, blocks: int) -> torch.Tensor:
    padded = F.pad(params, (0, 0, 0, blocks * BLOCK_COLUMNS - params.shape[0]))
    return padded.view(blocks, BLOCK_COLUMNS, -1).transpose(1, 2).contiguous()


def _unblocked(params: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if params is None:
        return None
    return params.transpose(1, 2).reshape(-1, params.shape[1])[:n]


# ---- the arithmetic, in PyTorch -----------------------------------------------------------


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[M, K] -> int8-valued codes [M, K] (float32), scales [M, K // 32], the codes' sums
    per 16 values [M, K // 16] (float32, exact): csrc's quantize_activations."""
    groups = x.float().reshape(x.shape[0], -1, ACTIVATION_GROUP)
    scales = groups.abs().amax(-1) / 127
    inverse = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))
    codes = torch.round(groups * inverse.unsqueeze(-1)).clamp(-127, 127).flatten(1)
    return codes, scales, codes.view(x.shape[0], -1, 16).sum(-1)


def reference_matmul(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ dequantized(weight).T as the kernel computes it, bit for bit: each group's dot
    product exact (float64 sums of integers), the groups' float32 terms added in K order."""
    codes, a_scales, a_sums = quantize_activations(x)
    rows, group = x.shape[0], weight.group
    dots = torch.einsum(
        "mgk,ngk->gmn",
        codes.double().view(rows, -1, group),
        weight.integers().double().view(weight.values.shape[0], -1, group),
    ).float()
    sums = a_sums if group == 16 else a_sums.view(rows, -1, 2).sum(-1)
    acc = torch.zeros(rows, weight.values.shape[0], dtype=torch.float32, device=x.device)
    for g in range(dots.shape[0]):
        a_scale = a_scales[:, g * group // ACTIVATION_GROUP].unsqueeze(1)
        acc = acc + dots[g] * weight.scales[:, g] * a_scale
        if weight.mins is not None:
            acc = acc + weight.mins[:, g] * (a_scale * sums[:, g : g + 1])
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


# ---- the matmul ---------------------------------------------------------------------------


class QuantLinear(SizedCalls):
    """y = x @ weight.T + bias with the weight kept quantized: Linear's interface.

    A fused weight may hold parts in different formats (a Q4_K_M file keeps some v and
    down projections in Q6_K): each part is its own packed weight, called on x (its op
    quantizes x, cheaply, for each), and the parts' outputs are concatenated. With `native`
    (torch.ops.cadence where the C++ kernel is registered) the parts are packed for it;
    without, the reference serves.
    """

    __slots__ = ("biases", "native", "packed", "parts", "row_sizes")

    def __init__(
        self,
        parts: Sequence[QuantWeight],
        bias: torch.Tensor | None = None,
        *,
        native: Any | None,
        dtype: torch.dtype,
        sizes: tuple[int, ...] = ROW_SIZES,
    ) -> None:
        parts = _merged(parts)
        self.native = native
        self.packed = [pack(p) for p in parts] if native is not None else []
        self.parts = [] if native is not None else list(parts)
        bounds = _bounds([p.values.shape[0] for p in parts])
        self.biases = [None if bias is None else bias[a:b].float() for a, b in bounds]
        k, device = parts[0].values.shape[1], parts[0].values.device
        self.row_sizes = _checked_sizes(self, parts, k, sizes, dtype, device)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The quantized matmul on exactly these rows."""
        if self.native is None:
            outs = [reference_matmul(x, p, b) for p, b in zip(self.parts, self.biases, strict=True)]
        else:
            outs = [
                p.matmul(self.native, x, b) for p, b in zip(self.packed, self.biases, strict=True)
            ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The served weight's rows `ids` in float32 (the LM head's refined logits)."""
        if self.native is None and len(self.parts) == 1:
            part = self.parts[0]
            mins = None if part.mins is None else part.mins[ids]
            values = _integers(part.kind, part.values[ids]).float()
            return _dequantized(values, part.scales[ids], mins, part.group)
        if len(self.packed) != 1:
            raise ValueError("dequantized_rows serves a weight of one part")
        return self.packed[0].dequantized_rows(ids)


Matmul = Linear | QuantLinear  # what a model's matmul is


def _merged(parts: Sequence[QuantWeight]) -> list[QuantWeight]:
    """Adjacent parts of one format as one: one kernel call instead of several."""
    merged: list[QuantWeight] = []
    for part in parts:
        last = merged[-1] if merged else None
        if last is None or _format(last) != _format(part):
            merged.append(part)
            continue
        mins = None if last.mins is None or part.mins is None else torch.cat((last.mins, part.mins))
        merged[-1] = QuantWeight(
            last.kind,
            torch.cat((last.values, part.values)),
            torch.cat((last.scales, part.scales)),
            mins,
            last.group,
        )
    return merged


def _format(weight: QuantWeight) -> tuple[str, int, bool]:
    return weight.kind, weight.group, weight.mins is not None


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


# By formats and shapes, dtype, device, native or not, threads and sizes: the kernel's
# order of operations depends on nothing else.
_CHECKED: dict[str, RowSizes] = {}


def _checked_sizes(
    linear: QuantLinear,
    parts: list[QuantWeight],
    k: int,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> RowSizes:
    described = repr(
        (
            [(*_format(p), p.values.shape[0]) for p in parts],
            k,
            [b is None for b in linear.biases],
            str(dtype),
            str(device),
            linear.native is not None,
            torch.get_num_threads(),
            sizes,
        )
    )
    if described not in _CHECKED:
        like = torch.empty(0, dtype=dtype, device=device)
        _CHECKED[described] = agreeing_sizes(linear.kernel, k, sizes, like)
    return _CHECKED[described]
