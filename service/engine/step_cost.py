"""What a step costs: a model of the worker's step time, fitted online to the measured steps.

    step_ms ~= base_ms + ms_per_token * tokens
               + ms_per_pair * prefill attention pairs + ms_per_context * decode context

A step's tokens pay for the matmuls (weights read once per step, then per-token work). Its
prefill attention pairs (each query token of a chunk times the keys it attends to) are what
make a 512-token chunk deep in a long prompt cost several times one at its start. Decode
attention is priced apart, per cached token a decoding sequence reads: it streams the KV
cache from memory, so a pair costs it another price than a chunk's compute-bound attention.
The fit is least squares over the steps seen, weighted so that older steps fade (the
machine's speed drifts with its load), with every coefficient kept non-negative: every term
if their fit is, else the best non-negative fit of fewer terms. Policies get the
coefficients as a `policies.base.StepCost` in their view; admission uses them to predict
how long a queue takes to prefill.
"""

from __future__ import annotations

import itertools

import numpy as np

from policies.base import StepCost, attention_pairs

# Steps fade by this factor per step: the fit follows the last few hundred steps.
_FORGET = 0.995
# The least steps before the fit is trusted.
_MIN_STEPS = 8
# Terms are scaled to comparable magnitudes (per 100 tokens, 100k pairs, 10k context
# tokens), so the normal equations stay well conditioned from decode-only steps to 4k-deep
# prefill chunks.
_SCALE = np.array([1.0, 1e-2, 1e-5, 1e-4])
_TERMS = len(_SCALE)
_RIDGE = 1e-6  # relative to the data's own scale: negligible wherever the data decides
# What `recent` may lag: a lone stream's step on a CPU is 10 ms, and a fit about 40 µs.
_REFIT_EVERY = 8


class StepCostModel:
    def __init__(self) -> None:
        self._xtx = np.zeros((_TERMS, _TERMS))
        self._xty = np.zeros(_TERMS)
        self._yty = 0.0
        self._steps = 0
        self._estimate: StepCost | None = None
        self._stale = False
        self._fitted_at = 0  # the steps seen at the last fit

    def observe(self, tokens: int, pairs: int, context: int, step_ms: float) -> None:
        """One measured step: `tokens` computed, `pairs` prefill attention pairs, `context`
        cached tokens its decodes read, `step_ms` taken."""
        if step_ms <= 0 or tokens < 1:
            return
        x = np.array([1.0, tokens, pairs, context]) * _SCALE
        self._xtx = _FORGET * self._xtx + np.outer(x, x)
        self._xty = _FORGET * self._xty + x * step_ms
        self._yty = _FORGET * self._yty + step_ms * step_ms
        self._steps += 1
        self._stale = True

    def observe_plan(
        self,
        num_tokens: list[int],
        start_pos: list[int],
        step_ms: float,
        drafted: list[int] | None = None,
    ) -> None:
        """A measured plan; `drafted`: each row's drafted tokens (Row.drafts)."""
        self.observe(*plan_terms(num_tokens, start_pos, drafted), step_ms)

    def estimate(self) -> StepCost | None:
        """The fitted coefficients, or None before enough steps were measured."""
        if self._stale and self._steps >= _MIN_STEPS:
            self._estimate = self._fit()
            self._stale = False
            self._fitted_at = self._steps
        return self._estimate

    def recent(self) -> StepCost | None:
        """The fitted coefficients, at most _REFIT_EVERY steps old: for a caller that
        asks every step and needs no more than the model's drift."""
        if self._estimate is not None and self._steps - self._fitted_at < _REFIT_EVERY:
            return self._estimate
        return self.estimate()

    def _fit(self) -> StepCost | None:
        """Every term if their fit is non-negative (no subset fits better); otherwise the
        best non-negative fit of fewer terms. Every subset is solved at once, as one batch
        of systems over all the terms, the left-out ones pinned to 0 (one solve of 15 took
        as long as each of the 15 did, about 35 µs)."""
        coefs = self._solve_subsets()
        feasible = np.asarray((coefs >= 0).all(axis=1))
        if feasible[0]:  # every term
            return _cost(coefs[0])
        if not feasible.any():
            return None
        residuals = (
            self._yty - 2 * coefs @ self._xty + np.einsum("si,ij,sj->s", coefs, self._xtx, coefs)
        )
        return _cost(coefs[int(np.argmin(np.where(feasible, residuals, np.inf)))])

    def _solve_subsets(self) -> np.ndarray:
        """Least squares over each of _TERM_SUBSETS, with a slight ridge: where the steps
        cannot tell terms apart (every decode step alike, no chunk seen yet) it shares the
        cost between them, instead of failing or swinging to huge opposite-signed values.
        [subsets, terms], 0 for the terms a subset leaves out."""
        ridge = _RIDGE * max(float(np.trace(self._xtx)), 1e-12) / _TERMS
        square = np.where(_SUBSET_SQUARES, self._xtx + ridge * np.eye(_TERMS), 0.0)
        rhs = np.where(_SUBSET_TERMS, self._xty, 0.0)
        return np.linalg.solve(square + _LEFT_OUT, rhs[..., None])[..., 0]


def plan_terms(
    num_tokens: list[int], start_pos: list[int], drafted: list[int] | None = None
) -> tuple[int, int, int]:
    """A plan's (tokens, prefill attention pairs, decode context). A decode with k drafts
    verifies k + 1 tokens against its cache as k + 1 decodes at consecutive positions
    would: priced by the keys each query reads, not as a prefill chunk's pairs, so that a
    verification at a deep context is not mistaken for costly prefill."""
    pairs = context = 0
    for i, (start, n) in enumerate(zip(start_pos, num_tokens, strict=True)):
        if n == 1 or (drafted and drafted[i]):
            context += n * start + n * (n - 1) // 2
        else:
            pairs += attention_pairs(start, n)
    return sum(num_tokens), pairs, context


_TERM_SUBSETS = [
    terms for size in range(_TERMS, 0, -1) for terms in itertools.combinations(range(_TERMS), size)
]
# each subset's terms, the square of the normal equations they span, and the identity on
# the terms it leaves out (which pins those to 0), made once
_SUBSET_TERMS = np.array([[t in terms for t in range(_TERMS)] for terms in _TERM_SUBSETS])
_SUBSET_SQUARES = _SUBSET_TERMS[:, :, None] & _SUBSET_TERMS[:, None, :]
_LEFT_OUT = np.array([np.diag(~terms).astype(float) for terms in _SUBSET_TERMS])


def _cost(coef: np.ndarray) -> StepCost:
    base, per_token, per_pair, per_context = (coef * _SCALE).tolist()
    return StepCost(
        base_ms=base, ms_per_token=per_token, ms_per_pair=per_pair, ms_per_context=per_context
    )
