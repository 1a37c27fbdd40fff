"""fcfs: arrival order, each prompt's whole prefill in one step, prefill first.

Optimizes throughput and simplicity, the way vLLM v0 did by default: while a prompt is
being prefilled, that step is the prefill alone, so decoding requests stall for as long as
it takes (the baseline the interference scenario measures). Several waiting prompts share
one prefill step when their whole prompts fit together in the budget.

A prompt longer than the budget (`max_batched_tokens`, default: the engine's hard cap) is
never rejected here: it is prefilled in budget-sized pieces over consecutive steps, still
prefill-first, so decodes stall until it is done. That is the only case in which fcfs
splits a prompt; run with a cap at least the longest prompt to avoid it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import AdapterBound, Decision, Policy, View


class Fcfs(Policy):
    name = "fcfs"
    summary = "Throughput baseline: arrival order, whole prefills first (decodes stall meanwhile)."

    @dataclass(frozen=True, slots=True)
    class Params:
        # 0: the engine's hard cap
        max_batched_tokens: int = field(default=0, metadata={"min": 0, "max": 1 << 20})
        # the most LoRA adapters one step's rows use (0: no bound)
        max_adapters_per_step: int = field(default=0, metadata={"min": 0, "max": 1 << 10})

    def decide(self, view: View) -> Decision:
        budget = view.max_batched_tokens
        if self.params.max_batched_tokens:
            budget = min(budget, self.params.max_batched_tokens)
        prefills = [s for s in view.running if not s.is_decoding]
        prefills += view.waiting[: max(0, view.max_seqs - len(view.running))]
        if prefills:
            decision = self._prefill_step(view, prefills, budget)
            if decision.schedule:
                return decision
        # no prefill, or none fits in memory right now: the decodes go on
        adapters = AdapterBound(self.params.max_adapters_per_step)
        decodes = [s for s in view.running if s.is_decoding and adapters.admits(s)]
        schedule = [(s.seq_id, 1) for s in decodes[: view.max_seqs]]
        return Decision(schedule=schedule, token_budget=budget)

    def _prefill_step(self, view: View, prefills: list, budget: int) -> Decision:
        adapters = AdapterBound(self.params.max_adapters_per_step)
        schedule: list[tuple[int, int]] = []
        free = view.free_blocks
        left = budget
        for seq in prefills:
            if len(schedule) >= view.max_seqs:
                break
            tokens = seq.remaining
            if tokens > left:
                if schedule:
                    break  # strict arrival order: the next prompt waits for its own step
                tokens = left  # longer than the whole budget: budget-sized pieces
            need = view.blocks_for(seq, tokens)
            if need > free:
                break
            if not adapters.admits(seq):
                continue  # its adapter waits for a step of its own
            schedule.append((seq.seq_id, tokens))
            free -= need
            left -= tokens
        return Decision(schedule=schedule, token_budget=budget)
