"""fair: per-tenant fairness by counting served tokens (a virtual token counter).

Optimizes fairness between tenants: each tenant has a counter of tokens served to it,
divided by its weight; the tenant with the smallest counter goes first, for both decodes
and prefill chunks, and each token given raises its tenant's counter as it is handed out.
A tenant that shows up (again) starts at the smallest counter among the active tenants,
so it cannot bank credit while idle (Sheng et al., "Fairness in Serving LLMs", VTC).
Counters count what this policy schedules; the rare token the core trims is ignored.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from policies.base import Decision, Policy, PolicyError, SeqView, View
from policies.packing import fill_budget, split_running


class Fair(Policy):
    name = "fair"
    summary = "Fairness between tenants: the tenant served the fewest (weighted) tokens goes first."

    @dataclass(frozen=True, slots=True)
    class Params:
        weights: dict = field(default_factory=dict)  # tenant -> weight (default 1.0)
        token_budget: int = field(default=512, metadata={"min": 1, "max": 1 << 20})
        chunk_size: int = field(default=512, metadata={"min": 1, "max": 1 << 20})

        def validate(self) -> None:
            for tenant, weight in self.weights.items():
                if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                    raise PolicyError(f"weight of {tenant!r} must be a number")
                if not 0 < weight <= 1e6:
                    raise PolicyError(f"weight of {tenant!r} must be in (0, 1e6]")

    def __init__(self, params: Params) -> None:
        super().__init__(params)
        self.counters: dict[str, float] = {}

    def weight(self, tenant: str) -> float:
        return float(self.params.weights.get(tenant, 1.0))

    def decide(self, view: View) -> Decision:
        active = {s.tenant for s in view.running} | {s.tenant for s in view.waiting}
        self._enrol(active)
        decoding, prefilling = split_running(view)
        decodes = self._interleave(decoding, tokens_each=lambda s: 1)
        prefills = self._interleave([*prefilling, *view.waiting], tokens_each=self._chunk)
        budget = self.params.token_budget
        decision = fill_budget(
            view,
            decodes,
            prefills,
            budget=budget,
            prefill_cap=budget,
            chunk_size=self.params.chunk_size,
        )
        by_id = {s.seq_id: s for s in (*view.running, *view.waiting)}
        for seq_id, tokens in decision.schedule:
            tenant = by_id[seq_id].tenant
            self.counters[tenant] += tokens / self.weight(tenant)
        return decision

    def _enrol(self, active: set[str]) -> None:
        known = [self.counters[t] for t in active if t in self.counters]
        floor = min(known, default=0.0)
        for tenant in list(self.counters):
            if tenant not in active:
                del self.counters[tenant]  # idle: forget, so it re-enters at the floor
        for tenant in active:
            self.counters.setdefault(tenant, floor)

    def _chunk(self, seq: SeqView) -> int:
        return min(seq.remaining, self.params.chunk_size)

    def _interleave(self, seqs: list[SeqView], tokens_each) -> list[SeqView]:
        """Order sequences by their tenant's counter, as if each got `tokens_each` in turn."""
        queues: dict[str, list[SeqView]] = {}
        for seq in seqs:
            queues.setdefault(seq.tenant, []).append(seq)
        heap = [(self.counters[t], t) for t in queues]
        heapq.heapify(heap)
        order: list[SeqView] = []
        positions = dict.fromkeys(queues, 0)
        while heap:
            counter, tenant = heapq.heappop(heap)
            queue = queues[tenant]
            seq = queue[positions[tenant]]
            order.append(seq)
            positions[tenant] += 1
            if positions[tenant] < len(queue):
                heapq.heappush(heap, (counter + tokens_each(seq) / self.weight(tenant), tenant))
        return order
