"""Packing a step: decodes first, then prefill chunks, in the orders a policy chooses.

The mechanism the chunking policies (stall_free, priority, fair, slo) share; each brings
its own ordering and budget.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.base import AdapterBound, Decision, SeqView, StepCost, View


def fill_budget(
    view: View,
    decodes: Iterable[SeqView],
    prefills: Iterable[SeqView],
    *,
    budget: int,
    prefill_cap: int,
    chunk_size: int,
    prefill_ms: float | None = None,
    cost: StepCost | None = None,
    max_adapters: int = 0,
) -> Decision:
    """Schedule `decodes` (one token each) then chunks of `prefills`, in the orders given.

    The step holds at most `budget` tokens (never more than the engine's cap), at most
    `prefill_cap` of them prefill, and at most view.max_seqs sequences. Waiting sequences
    are admitted only while the blocks of their whole prompt appear admittable and their
    chunk's blocks (plus those the decodes need) appear free.
    With `prefill_ms` and a `cost` model, the chunks together also add at most that much
    time by their cost at their positions (a chunk deep in a long prompt is shorter); the
    first chunk has at least one token, so a prompt always progresses.
    With `max_adapters`, the step's rows use at most that many LoRA adapters (AdapterBound).
    """
    adapters = AdapterBound(max_adapters)
    budget = budget_cap = min(budget, view.max_batched_tokens)
    schedule: list[tuple[int, int]] = []
    free = view.free_blocks
    for seq in decodes:
        if len(schedule) >= view.max_seqs or budget < 1:
            break
        if not adapters.admits(seq):
            continue
        schedule.append((seq.seq_id, 1))
        free -= view.blocks_for(seq, 1)
        budget -= 1
    prefill_left = min(budget, prefill_cap)
    admit_slots = view.max_seqs - len(view.running)  # the core caps running sequences too
    admittable = view.admittable_blocks
    for seq in prefills:
        if prefill_left < 1 or len(schedule) >= view.max_seqs:
            break
        waiting = seq.waiting
        if waiting and admit_slots < 1:
            continue
        whole = view.blocks_for(seq, seq.remaining) if waiting else 0
        if whole > admittable:
            continue  # the core admits only a whole prompt's blocks; a smaller one may fit
        chunk = min(seq.remaining, chunk_size, prefill_left)
        start = seq.num_computed_tokens
        if prefill_ms is not None and cost is not None:
            if prefill_ms <= 0:
                break
            chunk = cost.largest_chunk(start, prefill_ms, chunk)
        need = view.blocks_for(seq, chunk)
        if need > free or not adapters.admits(seq):
            continue  # a smaller prompt further down may still fit
        schedule.append((seq.seq_id, chunk))
        free -= need
        prefill_left -= chunk
        admit_slots -= waiting
        admittable -= whole
        if prefill_ms is not None and cost is not None:
            prefill_ms -= cost.chunk_ms(start, chunk)
    return Decision(schedule=schedule, token_budget=budget_cap)


def split_running(view: View) -> tuple[list[SeqView], list[SeqView]]:
    """Running sequences as (decoding, prefilling), each in admission order."""
    decoding = [s for s in view.running if s.is_decoding]
    prefilling = [s for s in view.running if not s.is_decoding]
    return decoding, prefilling
