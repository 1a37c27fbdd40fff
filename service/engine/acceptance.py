"""A request's record of its drafted tokens (speculative decoding): how many to draft next.

Its own module so that a Request can hold one without the speculator's imports, and the
speculator can read requests without a circle (service.engine.speculation says how the
record is used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# How much the latest step weighs in an exponential average (a request's acceptance, and
# speculation.Payoff's costs).
RATE_WEIGHT = 0.25
# A request that drafts nothing (poor acceptance) tries one token after this many decodes;
# speculation.Payoff measures the way it did not choose as often.
PROBE_EVERY = 16


@dataclass(slots=True)
class Acceptance:
    """One request's record of its drafts: how many to draft next, and its totals."""

    rate: float = 1.0  # exponential average of accepted / drafted; optimistic at first
    quiet: int = 0  # decode steps since it last drafted
    drafted: int = 0  # tokens drafted over its life
    accepted: int = 0  # of those, accepted by the worker

    def wanted(self, most: int) -> int:
        """Tokens to draft this step, at most `most` (0 when its drafts keep failing,
        except for a probe of one token now and then)."""
        k = min(most, math.floor(most * self.rate + 0.5))
        return min(most, 1) if k < 1 and self.quiet >= PROBE_EVERY else k

    def expected(self, k: int) -> float:
        """Drafted tokens a step of `k` drafts is expected to accept: a + ... + a^k, for
        each accepted with the request's average rate a once those before it were."""
        return sum(self.rate**i for i in range(1, k + 1))

    def record(self, drafted: int, accepted: int) -> None:
        """A decode step's outcome: `drafted` tokens verified, `accepted` of them kept."""
        if not drafted:
            self.quiet += 1
            return
        self.rate = (1 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * accepted / drafted
        self.quiet = 0
        self.drafted += drafted
        self.accepted += accepted
