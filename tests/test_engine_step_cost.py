"""The engine's step-cost model: fitted to measured steps, never negative, following drift."""

from __future__ import annotations

import random

import pytest

from policies.base import attention_pairs
from service.engine.step_cost import StepCostModel
from tests.sim_worker import SimWorker, collect, greedy, running_engine, sim_config


def observe_mixed_steps(model: StepCostModel, rng: random.Random, truth, count: int) -> None:
    """Decode steps of varied batch and context, and steps with a chunk at varied depth."""
    for _ in range(count):
        starts = [rng.randint(10, 2000) for _ in range(rng.randint(1, 32))]
        sizes = [1] * len(starts)
        if rng.random() < 0.3:
            starts.append(rng.randint(0, 4000))
            sizes.append(rng.randint(64, 512))
        model.observe_plan(sizes, starts, truth(sizes, starts) + rng.gauss(0.0, 1.0))


def linear_truth(base: float, per_token: float, per_pair: float, per_context: float = 0.0):
    def truth(sizes: list[int], starts: list[int]) -> float:
        pairs = sum(attention_pairs(s, n) for s, n in zip(starts, sizes, strict=True) if n > 1)
        context = sum(s for s, n in zip(starts, sizes, strict=True) if n == 1)
        return base + per_token * sum(sizes) + per_pair * pairs + per_context * context

    return truth


def test_no_estimate_before_eight_steps():
    model = StepCostModel()
    for _ in range(7):
        model.observe(10, 1000, 200, 20.0)
        assert model.estimate() is None
    model.observe(12, 1500, 300, 21.0)
    assert model.estimate() is not None


def test_the_fit_recovers_base_token_and_both_attention_costs_from_noisy_steps():
    model = StepCostModel()
    truth = linear_truth(20.0, 0.34, 4.2e-4, 1.5e-3)  # decode attention dearer per pair
    observe_mixed_steps(model, random.Random(1), truth, 400)
    cost = model.estimate()
    assert cost is not None
    assert cost.base_ms == pytest.approx(20.0, abs=1.0)
    assert cost.ms_per_token == pytest.approx(0.34, rel=0.05)
    assert cost.ms_per_pair == pytest.approx(4.2e-4, rel=0.05)
    assert cost.ms_per_context == pytest.approx(1.5e-3, rel=0.1)


def test_a_term_the_data_would_make_negative_is_dropped_not_negative():
    model = StepCostModel()
    rng = random.Random(2)
    # attention that looks cheaper the more of it there is: an unconstrained fit goes negative
    for _ in range(100):
        tokens, pairs = rng.randint(1, 512), rng.randint(0, 10**6)
        model.observe(tokens, pairs, 0, 10.0 + 0.5 * tokens - 1e-6 * pairs)
    cost = model.estimate()
    assert cost is not None
    assert min(cost.base_ms, cost.ms_per_token, cost.ms_per_pair) >= 0
    assert cost.ms_per_pair == 0.0


def test_steps_that_cannot_tell_the_terms_apart_still_give_a_usable_estimate():
    model = StepCostModel()
    for _ in range(20):
        model.observe(16, 0, 16 * 300, 30.0)  # the same decode step over and over
    cost = model.estimate()
    assert cost is not None
    predicted = cost.base_ms + cost.ms_per_token * 16 + cost.ms_per_context * 16 * 300
    assert predicted == pytest.approx(30.0, rel=1e-6)


def test_the_fit_follows_a_machine_that_slows_down():
    model = StepCostModel()
    rng = random.Random(3)
    observe_mixed_steps(model, rng, linear_truth(20.0, 0.3, 4e-4), 300)
    observe_mixed_steps(model, rng, linear_truth(40.0, 0.6, 8e-4), 1500)
    cost = model.estimate()
    assert cost is not None
    assert cost.ms_per_token == pytest.approx(0.6, rel=0.1)
    assert cost.ms_per_pair == pytest.approx(8e-4, rel=0.1)


def test_steps_without_tokens_or_time_are_ignored():
    model = StepCostModel()
    for _ in range(10):
        model.observe(0, 0, 0, 5.0)
        model.observe(4, 100, 50, 0.0)
    assert model.estimate() is None


async def test_the_engine_fits_the_workers_step_times_and_reports_the_fit(autojump_clock):
    worker = SimWorker(base_ms=8.0, per_token_ms=0.25, per_seq_ms=0.0, per_pair_ms=2e-4)
    async with running_engine(sim_config(), worker) as engine:
        assert engine.state()["step_cost"] is None
        channels = [
            await engine.submit([i + 1] * (50 + 300 * i), greedy(20), request_id=f"r{i}")
            for i in range(4)
        ]
        for channel in channels:
            await collect(channel)
        fit = engine.state()["step_cost"]
    assert fit["base_ms"] == pytest.approx(8.0, rel=0.01)
    assert fit["ms_per_token"] == pytest.approx(0.25, rel=0.01)
    assert fit["ms_per_pair"] == pytest.approx(2e-4, rel=0.01)
    assert fit["ms_per_context"] == pytest.approx(2e-4, rel=0.01)  # the sim prices both alike
