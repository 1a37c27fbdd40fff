"""stall_free: decode tokens first, then prefill chunks fill what is left of the budget.

Optimizes inter-token latency of running requests (Sarathi-Serve's stall-free batching):
every step carries all decodes, so a long prompt arriving never freezes their streams;
its prefill is spread over several budget-sized steps, raising its own TTFT in exchange.

`fill_budget` is the mechanism the other chunking policies (priority, fair, slo) reuse
with their own orderings and budgets.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from policies.base import Decision, Policy, PolicyError, SeqView, View


def fill_budget(
    view: View,
    decodes: Iterable[SeqView],
    prefills: Iterable[SeqView],
    *,
    budget: int,
    prefill_cap: int,
    chunk_size: int,
) -> Decision:
    """Schedule `decodes` (one token each) then chunks of `prefills`, in the orders given.

    The step holds at most `budget` tokens (never more than the engine's cap), at most
    `prefill_cap` of them prefill, and at most view.max_seqs sequences. Waiting sequences
    are admitted only while their blocks (plus those the decodes need) appear to fit.
    """
    budget = min(budget, view.max_batched_tokens)
    schedule: list[tuple[int, int]] = []
    free = view.free_blocks
    for seq in decodes:
        if len(schedule) >= view.max_seqs or budget < 1:
            break
        schedule.append((seq.seq_id, 1))
        free -= view.blocks_for(seq, 1)
        budget -= 1
    prefill_left = min(budget, prefill_cap)
    admit_slots = view.max_seqs - len(view.running)  # the core caps running sequences too
    for seq in prefills:
        if prefill_left < 1 or len(schedule) >= view.max_seqs:
            break
        waiting = seq.num_blocks == 0  # a running sequence always holds a block
        if waiting and admit_slots < 1:
            continue
        chunk = min(seq.remaining, chunk_size, prefill_left)
        need = view.blocks_for(seq, chunk)
        if need > free:
            continue  # a smaller prompt further down may still fit
        schedule.append((seq.seq_id, chunk))
        free -= need
        prefill_left -= chunk
        admit_slots -= waiting
    return Decision(schedule=schedule)


def split_running(view: View) -> tuple[list[SeqView], list[SeqView]]:
    """Running sequences as (decoding, prefilling), each in admission order."""
    decoding = [s for s in view.running if s.is_decoding]
    prefilling = [s for s in view.running if not s.is_decoding]
    return decoding, prefilling


class StallFree(Policy):
    name = "stall_free"
    summary = "Steady token streams: every decode each step, prefill chunks fill the rest."

    @dataclass(frozen=True, slots=True)
    class Params:
        token_budget: int = field(default=512, metadata={"min": 1, "max": 1 << 20})
        # with decodes present, at most this share of the budget goes to prefill
        max_prefill_share: float = field(default=1.0, metadata={"min": 0.0, "max": 1.0})
        chunk_size: int = field(default=512, metadata={"min": 1, "max": 1 << 20})

        def validate(self) -> None:
            if self.max_prefill_share * self.token_budget < 1 and self.max_prefill_share > 0:
                raise PolicyError("max_prefill_share * token_budget must allow one token")

    def decide(self, view: View) -> Decision:
        p = self.params
        decoding, prefilling = split_running(view)
        budget = min(p.token_budget, view.max_batched_tokens)
        prefill_cap = budget
        if decoding:
            # at least one token of prefill per step, so a prompt always progresses
            prefill_cap = max(1, int(p.max_prefill_share * budget))
        return fill_budget(
            view,
            decoding,
            [*prefilling, *view.waiting],
            budget=budget,
            prefill_cap=prefill_cap,
            chunk_size=p.chunk_size,
        )
