"""slo: adapt the prefill chunk so the measured step time stays under an ITL target.

Optimizes goodput under an inter-token-latency objective: every step carries all decodes
(as stall_free) and a prefill allowance sized from the measured cost per token of the
previous steps (View.last_step_ms / last_step_tokens, smoothed), aiming at
`headroom * itl_target_ms`. A step that overshot shrinks the allowance at once; growth is
at most doubling per step, so one cheap step cannot trigger a huge prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import Decision, Policy, View
from policies.packing import fill_budget, split_running


class Slo(Policy):
    name = "slo"
    summary = "Inter-token latency target: the prefill chunk adapts so each step stays under it."

    @dataclass(frozen=True, slots=True)
    class Params:
        itl_target_ms: float = field(default=100.0, metadata={"min": 0.1, "max": 1e6})
        headroom: float = field(default=0.9, metadata={"min": 0.1, "max": 1.0})
        min_chunk: int = field(default=16, metadata={"min": 1, "max": 1 << 20})
        max_budget: int = field(default=4096, metadata={"min": 1, "max": 1 << 20})
        smoothing: float = field(default=0.5, metadata={"min": 0.0, "max": 0.99})

    def __init__(self, params: Params) -> None:
        super().__init__(params)
        self.ms_per_token: float | None = None
        self.budget = params.min_chunk

    def decide(self, view: View) -> Decision:
        p = self.params
        self._learn(view)
        decoding, prefilling = split_running(view)
        if self.ms_per_token is not None:
            affordable = int(p.headroom * p.itl_target_ms / self.ms_per_token)
            self.budget = max(1, min(affordable, 2 * self.budget, p.max_budget))
        prefill_cap = max(p.min_chunk, self.budget - len(decoding))
        return fill_budget(
            view,
            decoding,
            [*prefilling, *view.waiting],
            budget=len(decoding) + prefill_cap,
            prefill_cap=prefill_cap,
            chunk_size=prefill_cap,
        )

    def _learn(self, view: View) -> None:
        if view.last_step_ms is None or view.last_step_tokens < 1:
            return
        sample = view.last_step_ms / view.last_step_tokens
        if self.ms_per_token is None:
            self.ms_per_token = sample
            return
        if view.last_step_ms > self.params.itl_target_ms:
            self.ms_per_token = max(self.ms_per_token, sample)  # react to overshoot at once
            return
        a = self.params.smoothing
        self.ms_per_token = a * self.ms_per_token + (1 - a) * sample
