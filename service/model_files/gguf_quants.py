"""llama.cpp's quantized blocks repacked, without loss, into the worker's three formats.

The worker serves a weight kept quantized as q8 (int8 values in groups of 32 or 16, a
float32 scale and optional min per group), q5 or q4 (values 0..31 or 0..15 in groups of 32,
a float32 scale and min): w = scale * value + min (gpu_worker.quant, which tells q4 from q5
by the values' range). Every block type below maps onto one of them exactly: its scales are
fp16, or fp16 times a 6- or 8-bit integer (exact in float32), and scale * value + min in
float32 gives the same bits as gguf.quants.dequantize, operation for operation (a min of -8
or -16 scales is exact too). The values are read as gguf.quants reads them.

    Q8_0 -> q8/32          Q4_0 -> q4 (min = -8 scale)   Q4_1 -> q4
    Q5_0 -> q5 (min = -16 scale)  Q5_1 -> q5             Q4_K -> q4 (min = -dmin * m)
    Q5_K -> q5 (min = -dmin * m)                         Q6_K -> q8/16
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

QK_K = 256  # values per K-quant super-block


@dataclass(frozen=True, slots=True)
class Repacked:
    """A [rows, K] weight: values int8 (q8) or uint8 (q4, q5) [rows, K], scales and mins
    float32 [rows, K // group] (mins None: 0)."""

    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        group = self.values.shape[1] // self.scales.shape[1]
        w = self.values.astype(np.float32) * np.repeat(self.scales, group, axis=1)
        return w if self.mins is None else w + np.repeat(self.mins, group, axis=1)

    def rows_permuted(self, permute: Callable[[np.ndarray], np.ndarray]) -> Repacked:
        """The same weight with its output rows reordered by `permute` (of a [rows, ...])."""
        mins = None if self.mins is None else permute(self.mins)
        return Repacked(permute(self.values), permute(self.scales), mins)


# Per block type: blocks [n, bytes] -> (values [n, block], scales [n, groups], mins or None)
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _fp16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, width: int) -> np.ndarray:
    """Low nibbles of each `width` bytes, then their high nibbles, as gguf.quants does."""
    shifted = qs.reshape((n, -1, 1, width)) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(0x0F)).reshape((n, -1))


def _q8_0(blocks: np.ndarray) -> Unpacked:
    return blocks[:, 2:].view(np.int8), _fp16(blocks[:, :2]), None


def _q4_0(blocks: np.ndarray) -> Unpacked:
    d = _fp16(blocks[:, :2])
    return _nibbles(blocks[:, 2:], blocks.shape[0], 16), d, -8 * d


def _q4_1(blocks: np.ndarray) -> Unpacked:
    n = blocks.shape[0]
    return _nibbles(blocks[:, 4:], n, 16), _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    n = qs.shape[0]
    high = qh.copy().view(np.uint32).reshape((n, 1)) >> np.arange(32, dtype=np.uint32)
    return _nibbles(qs, n, 16) | ((high & np.uint32(1)).astype(np.uint8) << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> Unpacked:
    d = _fp16(blocks[:, :2])
    return _five_bits(blocks[:, 2:6], blocks[:, 6:]), d, -16 * d


def _q5_1(blocks: np.ndarray) -> Unpacked:
    q = _five_bits(blocks[:, 4:8], blocks[:, 8:])
    return q, _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per-32 scale and min: d * sc and -(dmin * m), in float32."""
    n = blocks.shape[0]
    d, dmin = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape((n, 3, 4))
    low, high, both = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    m = np.concatenate([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> Unpacked:
    scales, mins = _k_scales(blocks)
    return _nibbles(blocks[:, 16:], blocks.shape[0], 32), scales, mins


def _q5_k(blocks: np.ndarray) -> Unpacked:
    n = blocks.shape[0]
    scales, mins = _k_scales(blocks)
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    high = qh.reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))
    high = (high & np.uint8(1)).reshape((n, -1))
    return _nibbles(qs, n, 32) | (high << np.uint8(4)), scales, mins


def _q6_k(blocks: np.ndarray) -> Unpacked:
    n = blocks.shape[0]
    ql, qh = blocks[:, : QK_K // 2], blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    sc = blocks[:, QK_K // 2 + QK_K // 4 : -2].view(np.int8).astype(np.float32)
    d = _fp16(blocks[:, -2:])
    low = (ql.reshape((n, -1, 1, 64)) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    low, high = low.reshape((n, -1, 32)), (high & np.uint8(3)).reshape((n, -1, 32))
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape((n, -1)), d * sc, None


REPACKERS: dict[T, Callable[[np.ndarray], Unpacked]] = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)  # served dense, as they are


def repack(data: np.ndarray, kind: T, shape: tuple[int, int]) -> Repacked:
    """A GGUF tensor's raw blocks (its `data`) as a [rows, K] Repacked weight."""
    size = GGML_QUANT_SIZES[kind][1]
    rows, k = shape
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)
    values, scales, mins = REPACKERS[kind](blocks)
    values = values.reshape(rows, k)
    scales = np.ascontiguousarray(scales.reshape(rows, -1), dtype=np.float32)
    if mins is not None:
        mins = np.ascontiguousarray(mins.reshape(rows, -1), dtype=np.float32)
    return Repacked(np.ascontiguousarray(values), scales, mins)
