"""priority: lower priority value first (vLLM's meaning, default 0), with aging so that
nothing waits forever.

Optimizes latency of important requests; as in vLLM, a request's `priority` is a number
where LOWER runs first. Effective priority = priority - aging_rate * seconds since
arrival, so a request of a large value that has waited long eventually outranks newer
ones of smaller values; the smallest effective value goes first, among equals the earlier
deadline, then the earlier arrival. Decodes and prefill chunks are ordered so and packed
into the budget as under stall_free. With `preempt`, when a waiting request finds every
sequence slot taken (--max-num-seqs) or KV blocks short, running requests of a strictly
higher base priority value (less important) are named for preemption (the least important
first), as vLLM's priority scheduling preempts; they are recomputed later with the same
output. The strict base-priority rule prevents two requests from evicting each other in
turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import Decision, Policy, SeqView, View, by_deadline
from policies.packing import fill_budget, split_running


class Priority(Policy):
    name = "priority"
    summary = (
        "Latency of important requests: lowest (aged) priority value first, as vLLM; "
        "optional preemption."
    )

    @dataclass(frozen=True, slots=True)
    class Params:
        aging_rate: float = field(default=1.0, metadata={"min": 0.0, "max": 1e6})  # per second
        preempt: bool = True
        token_budget: int = field(default=512, metadata={"min": 1, "max": 1 << 20})
        chunk_size: int = field(default=512, metadata={"min": 1, "max": 1 << 20})

    def effective(self, seq: SeqView, now: float) -> float:
        """Lower runs first; waiting lowers it, so nothing waits forever."""
        return seq.priority - self.params.aging_rate * max(0.0, now - seq.arrival)

    def decide(self, view: View) -> Decision:
        p = self.params

        def rank(s: SeqView) -> tuple[float, bool, float, float]:
            return (self.effective(s, view.now), *by_deadline(s))

        decoding, prefilling = split_running(view)
        decoding.sort(key=rank)
        prefills = sorted([*prefilling, *view.waiting], key=rank)
        decision = fill_budget(
            view,
            decoding,
            prefills,
            budget=p.token_budget,
            prefill_cap=p.token_budget,
            chunk_size=p.chunk_size,
        )
        if p.preempt and view.waiting:
            decision.preempt = self._victims(view, prefills, decision, rank)
        return decision

    def _victims(self, view: View, prefills: list[SeqView], decision: Decision, rank) -> list[int]:
        """Running sequences to give up for the best waiting one that did not fit for want
        of a sequence slot or of KV blocks."""
        scheduled = {seq_id for seq_id, _ in decision.schedule}
        waiting = {s.seq_id for s in view.waiting}
        candidates = (s for s in prefills if s.seq_id in waiting and s.seq_id not in scheduled)
        blocked = next(candidates, None)
        if blocked is None:
            return []
        budget = min(self.params.token_budget, view.max_batched_tokens)
        chunk = min(blocked.remaining, budget, self.params.chunk_size)
        slots_short = len(view.running) + 1 - view.max_seqs
        by_id = {s.seq_id: s for s in (*view.running, *view.waiting)}

        def blocks_short(victims: list[int]) -> int:
            """What the step lacks with `victims` gone: the blocks of what it keeps and of the
            blocked prompt whole (the core admits a whole prompt's, not a chunk's), beyond
            the admittable ones and the victims'."""
            kept = [(i, t) for i, t in decision.schedule if i not in victims]
            need = sum(view.blocks_for(by_id[i], t) for i, t in kept)
            need += view.blocks_for(blocked, blocked.remaining)
            freed = sum(by_id[i].num_blocks for i in victims)
            return need - view.admittable_blocks - freed

        if slots_short <= 0 and blocks_short([]) <= 0:
            return []  # left out for the token budget alone: no one is in its way
        victims: list[int] = []
        # the least important first: the largest effective value, latest deadline, arrival
        for seq in sorted(view.running, key=rank, reverse=True):
            if slots_short <= 0 and blocks_short(victims) <= 0:
                break
            if seq.priority > blocked.priority:  # strictly less important, by base value
                victims.append(seq.seq_id)
                slots_short -= 1
        kept = [e for e in decision.schedule if e[0] not in set(victims)]
        chunk = min(chunk, budget - sum(tokens for _, tokens in kept))
        if slots_short > 0 or blocks_short(victims) > 0 or chunk < 1:
            return []  # evicting them would not make room: keep everyone running
        decision.schedule = [*kept, (blocked.seq_id, chunk)]
        return victims
