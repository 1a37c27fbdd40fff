"""Seeded rows' random numbers: a counter-based generator keyed by (seed, position).

A seeded row's uniform at a position is a pure function of its seed and that position, so
it draws the same token whatever else is in the batch, in whatever order, and after being
preempted and recomputed. Every seeded row of a step gets its number in one vectorised pass
over [rows] int64 tensors: no generator object per row.

The definition: splitmix64 (Steele, Lea and Flood, Fast Splittable Pseudorandom Number
Generators, 2014; Vigna's published constants), its stream started at the state
mix64(seed) (mix64 is splitmix64's finaliser, a bijection of 64-bit words, so distinct
seeds start distinct streams) and read at output number `position` (from 0):

    bits = mix64(mix64(seed) + (position + 1) * GAMMA)      (mod 2**64)
    uniform = (bits >> 40) / 2**24                          (the top 24 bits)

A seed is taken mod 2**64 (a request's n sequences take seed + i, which may pass 2**63).
24 bits, not the 53 a float64 holds, because the draw looks the number up in a float32
CDF: a 53-bit uniform rounded to float32 can reach 1.0, whereas k / 2**24 is exact in
float32 and below 1.

torch has no unsigned 64-bit arithmetic on every device, so the words are int64: adds and
multiplies wrap mod 2**64 on the CPU and on CUDA alike (two's complement), and a logical
right shift is the arithmetic one with the sign bits masked off. The same integer ops give
the same bits on either device; tests/test_worker_sampler_seeded.py pins them to a
pure-Python splitmix64.

These numbers differ from those of the releases that seeded a torch.Generator per row with
a hash of (seed, position): a seed still gives reproducible tokens, but not the same ones
as then.
"""

from __future__ import annotations

import torch

_WORD = 1 << 64
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / golden ratio, odd
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24


def as_int64(word: int) -> int:
    """An integer mod 2**64, as the int64 with the same bits."""
    word %= _WORD
    return word - _WORD if word >= _WORD >> 1 else word


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 seeds (as_int64 of each seed) and positions, [rows] -> float32 U[0, 1) [rows]."""
    return uniform_of_bits(seeded_bits(seeds, positions))


def seeded_bits(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The int64 words the uniforms come from: splitmix64's output number `position` of the
    stream that starts at mix64(seed)."""
    return mix64(mix64(seeds) + (positions + 1) * as_int64(GAMMA))


def mix64(words: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of each int64 word."""
    words = (words ^ _shift_right(words, 30)) * as_int64(_MIX1)
    words = (words ^ _shift_right(words, 27)) * as_int64(_MIX2)
    return words ^ _shift_right(words, 31)


def uniform_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 words -> float32 in [0, 1): their top UNIFORM_BITS bits over 2**UNIFORM_BITS."""
    top = _shift_right(bits, 64 - UNIFORM_BITS)
    return top.to(torch.float32) * (1.0 / (1 << UNIFORM_BITS))


def _shift_right(words: torch.Tensor, by: int) -> torch.Tensor:
    """The logical (unsigned) right shift of int64 words: torch's >> extends the sign."""
    return (words >> by) & ((1 << (64 - by)) - 1)
