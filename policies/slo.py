"""slo: size each step's prefill so the predicted step time stays under an ITL target.

Optimizes goodput under an inter-token-latency objective: every step carries all decodes
(as stall_free) and prefill chunks whose predicted cost, by the engine's fitted step-cost
model (View.step_cost: base, per token, per attention pair), fills what the decodes leave
of `headroom * itl_target_ms`. A chunk's cost counts its position: deep in a long prompt,
where every token attends to thousands of keys, chunks are shorter; at its start they are
long, so the prompt's TTFT pays only for the time the target really leaves. At least
`min_chunk` tokens of prefill run each step, so a prompt progresses even when the decodes
alone use the whole target. Until the model has measured enough steps, prefill runs
`min_chunk` tokens per step. Waiting requests start earliest deadline first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import Decision, Policy, View, by_deadline
from policies.packing import fill_budget, split_running


class Slo(Policy):
    name = "slo"
    summary = "Inter-token latency target: prefill chunks sized by their predicted cost."

    @dataclass(frozen=True, slots=True)
    class Params:
        itl_target_ms: float = field(default=100.0, metadata={"min": 0.1, "max": 1e6})
        headroom: float = field(default=0.9, metadata={"min": 0.1, "max": 1.0})
        min_chunk: int = field(default=16, metadata={"min": 1, "max": 1 << 20})
        max_budget: int = field(default=4096, metadata={"min": 1, "max": 1 << 20})

    def decide(self, view: View) -> Decision:
        p = self.params
        decoding, prefilling = split_running(view)
        # started prefills first; then the waiting by the time by which they must start
        prefills = [*prefilling, *sorted(view.waiting, key=by_deadline)]
        cost = view.step_cost
        if cost is None:
            prefill_ms = None
            prefill_cap = p.min_chunk
        else:
            prefill_ms = p.headroom * p.itl_target_ms - cost.decode_ms(
                [s.num_computed_tokens for s in decoding]
            )
            prefill_cap = p.max_budget
            if prefill_ms < cost.chunk_ms(0, p.min_chunk):
                prefill_ms, prefill_cap = None, p.min_chunk  # the floor that keeps prefill moving
        return fill_budget(
            view,
            decoding,
            prefills,
            budget=len(decoding) + prefill_cap,
            prefill_cap=prefill_cap,
            chunk_size=prefill_cap,
            prefill_ms=prefill_ms,
            cost=cost,
        )
