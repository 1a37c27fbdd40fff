"""Seeded sampling: the counter-based generator (gpu_worker.counter_rng) pinned to a pure-Python
splitmix64, its uniforms' range and distribution, and a seeded row's token as a function of
(seed, position) alone."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.counter_rng import as_int64, seeded_bits, seeded_uniforms, uniform_of_bits
from gpu_worker.protocol import SamplingSpec
from gpu_worker.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
MASK = (1 << 64) - 1
# splitmix64's published constants, written out here rather than imported: the test pins
# the definition, not whatever the module says
GAMMA = 0x9E3779B97F4A7C15


def mix64_reference(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def bits_reference(seed: int, position: int) -> int:
    """splitmix64 run step by step: its stream starts at mix64(seed), and the draw at a
    position is its output number `position` (from 0)."""
    state = mix64_reference(seed & MASK)
    for _ in range(position + 1):
        state = (state + GAMMA) & MASK
    return mix64_reference(state)


def words(values: list[int]) -> torch.Tensor:
    return torch.tensor([as_int64(v) for v in values], dtype=torch.int64)


def test_the_bits_are_splitmix64s_from_a_pure_python_reference():
    # seeds past 2**63: a request's n sequences take seed + i from seeds up to 2**63 - 1
    seeds = [0, 1, 41, 2**32 + 7, 2**63 - 1, 2**63, 2**64 - 1]
    positions = [0, 1, 2, 17, 1000, 4095, 63]
    bits = seeded_bits(words(seeds), torch.tensor(positions))
    expected = [bits_reference(s, p) for s, p in zip(seeds, positions, strict=True)]
    assert [b & MASK for b in bits.tolist()] == expected
    uniforms = seeded_uniforms(words(seeds), torch.tensor(positions))
    assert uniforms.tolist() == [(b >> 40) / 2**24 for b in expected]


def test_uniforms_lie_in_zero_one_at_the_extreme_words():
    extremes = uniform_of_bits(words([MASK, 0, 1 << 63, (1 << 63) - 1]))
    assert extremes.dtype == torch.float32
    assert extremes.tolist() == [1 - 2**-24, 0.0, 0.5, 0.5 - 2**-24]
    seeds, positions = torch.meshgrid(torch.arange(50), torch.arange(200), indexing="ij")
    uniforms = seeded_uniforms(seeds.flatten(), positions.flatten())
    assert uniforms.min() >= 0 and uniforms.max() < 1


def test_distinct_seeds_and_positions_give_distinct_draws():
    # siblings (seed, seed + 1, ...) included: splitmix64 keyed by the seed alone would read
    # the same stream shifted by a position
    seeds, positions = torch.meshgrid(torch.arange(20), torch.arange(200), indexing="ij")
    bits = seeded_bits(seeds.flatten(), positions.flatten())
    assert len(set(bits.tolist())) == 20 * 200


def test_a_seeded_row_samples_its_cdf_at_its_counter_uniform():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(4)) * 2
    spec = SamplingSpec(temperature=0.8, seed=2**63 - 1 + 3)  # a sibling past 2**63
    positions = list(range(200))
    tokens = Sampler(0, CPU).sample(logits.expand(200, -1), [spec] * 200, positions).tokens
    cdf = torch.softmax(logits / 0.8, dim=-1).cumsum(dim=-1)
    uniforms = seeded_uniforms(words([spec.seed or 0] * 200), torch.tensor(positions))
    targets = uniforms[:, None] * cdf[:, -1:]
    expected = torch.searchsorted(cdf.expand(200, -1).contiguous(), targets, right=True)
    assert tokens == expected[:, 0].tolist()


def test_a_seeded_token_depends_only_on_its_seed_and_position():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=generator) * 2
    seeded = [SamplingSpec(temperature=1.3, top_p=0.95, top_k=30, seed=100 + r) for r in range(6)]
    alone = {
        (r, pos): Sampler(0, CPU).sample(logits[r : r + 1], [seeded[r]], [pos]).tokens[0]
        for r in range(6)
        for pos in range(8)
    }
    others = [SamplingSpec(), SamplingSpec(temperature=0.7, top_k=3), SamplingSpec(temperature=2)]
    shuffle = random.Random(5)
    batched = Sampler(99, CPU)  # another worker seed, its generator advancing step by step
    for pos in range(8):
        # each row where it lands in a shuffled batch with unseeded rows, at other positions
        rows = [(r, seeded[r], pos) for r in range(6)]
        rows += [(k % 6, spec, 50 + k) for k, spec in enumerate(others)]
        shuffle.shuffle(rows)
        batch = torch.stack([logits[r] for r, _, _ in rows])
        tokens = batched.sample(batch, [s for _, s, _ in rows], [p for _, _, p in rows]).tokens
        for (r, spec, _), token in zip(rows, tokens, strict=True):
            if spec.seed is not None:
                assert token == alone[r, pos]
    assert len({alone[0, pos] for pos in range(8)}) > 1  # the position does change the draw
    assert len({alone[r, 3] for r in range(6)}) > 1  # and so does the seed


# 12 categories with known probabilities; the p = 0.001 critical value of chi-square with 11
# degrees of freedom, from a table (scipy.stats.chi2.ppf(0.999, 11) = 31.264; no scipy here)
PROBABILITIES = [0.25, 0.15, 0.12, 0.1, 0.08, 0.07, 0.06, 0.05, 0.04, 0.04, 0.02, 0.02]
CHI2_CRITICAL_11_DF = 31.264


def test_seeded_draws_follow_the_distribution_chi_square():
    logits = torch.log(torch.tensor(PROBABILITIES))
    seeds = list(range(1000, 1080))  # 80 seeds x 75 positions: both keys vary
    positions = list(range(75))
    specs = [SamplingSpec(temperature=1.0, seed=s) for s in seeds for _ in positions]
    at = [p for _ in seeds for p in positions]
    tokens = Sampler(0, CPU).sample(logits.expand(len(specs), -1), specs, at).tokens
    counts = torch.bincount(torch.tensor(tokens), minlength=len(PROBABILITIES)).double()
    expected = torch.tensor(PROBABILITIES, dtype=torch.float64) * len(tokens)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL_11_DF
