"""What a step costs: a model of the worker's step time, fitted online to the measured steps.

    step_ms ~= base_ms + ms_per_token * tokens + ms_per_pair * attention pairs

A step's tokens pay for the matmuls (weights read once per step, then per-token work); its
attention pairs (each query token times the keys it attends to) pay for attention, which is
what makes a 512-token chunk deep in a long prompt cost several times one at its start.
The fit is least squares over the steps seen, weighted so that older steps fade (the
machine's speed drifts with its load), with every coefficient kept non-negative: the
subset of terms with the smallest error among the non-negative solutions wins. Policies
get the coefficients as a `policies.base.StepCost` in their view; admission uses them to
predict how long a queue takes to prefill.
"""

from __future__ import annotations

import itertools

import numpy as np

from policies.base import StepCost, attention_pairs

# Steps fade by this factor per step: the fit follows the last few hundred steps.
_FORGET = 0.995
# The least steps before the fit is trusted.
_MIN_STEPS = 8
# Terms are scaled to comparable magnitudes (ms per 100 tokens, per 100k pairs), so
# the normal equations stay well conditioned from decode-only to 4k-deep prefill steps.
_SCALE = np.array([1.0, 1e-2, 1e-5])


class StepCostModel:
    def __init__(self) -> None:
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._yty = 0.0
        self._steps = 0
        self._estimate: StepCost | None = None
        self._stale = False

    def observe(self, tokens: int, pairs: int, step_ms: float) -> None:
        """One measured step: `tokens` computed, `pairs` attention pairs, `step_ms` taken."""
        if step_ms <= 0 or tokens < 1:
            return
        x = np.array([1.0, tokens, pairs]) * _SCALE
        self._xtx = _FORGET * self._xtx + np.outer(x, x)
        self._xty = _FORGET * self._xty + x * step_ms
        self._yty = _FORGET * self._yty + step_ms * step_ms
        self._steps += 1
        self._stale = True

    def observe_plan(self, num_tokens: list[int], start_pos: list[int], step_ms: float) -> None:
        pairs = sum(attention_pairs(s, n) for s, n in zip(start_pos, num_tokens, strict=True))
        self.observe(sum(num_tokens), pairs, step_ms)

    def estimate(self) -> StepCost | None:
        """The fitted coefficients, or None before enough steps were measured."""
        if self._stale and self._steps >= _MIN_STEPS:
            self._estimate = self._fit()
            self._stale = False
        return self._estimate

    def _fit(self) -> StepCost | None:
        """Every term if their fit is non-negative (no subset fits better); otherwise the
        best non-negative fit of fewer terms."""
        fits = []
        for terms in _TERM_SUBSETS:
            coef = self._solve(terms)
            if coef is not None and (coef >= 0).all():
                if len(terms) == 3:
                    return _cost(coef)
                fits.append((self._residual(coef), coef))
        return _cost(min(fits, key=lambda fit: fit[0])[1]) if fits else None

    def _solve(self, terms: tuple[int, ...]) -> np.ndarray | None:
        index = np.array(terms)
        a = self._xtx[np.ix_(index, index)]
        if np.linalg.matrix_rank(a, tol=1e-9 * max(1.0, float(np.abs(a).max()))) < len(terms):
            return None  # these steps cannot tell the terms apart (e.g. all the same size)
        coef = np.zeros(3)
        coef[index] = np.linalg.solve(a, self._xty[index])
        return coef

    def _residual(self, coef: np.ndarray) -> float:
        return float(self._yty - 2 * coef @ self._xty + coef @ self._xtx @ coef)


_TERM_SUBSETS = [terms for size in (3, 2, 1) for terms in itertools.combinations(range(3), size)]


def _cost(coef: np.ndarray) -> StepCost:
    base, per_token, per_pair = (coef * _SCALE).tolist()
    return StepCost(base_ms=base, ms_per_token=per_token, ms_per_pair=per_pair)
