"""Hand-built views for policy tests: a sequence in any state, and the view around them."""

from __future__ import annotations

import dataclasses

from policies.base import SeqView, StepCost, View

BLOCK = 16


def seq(
    seq_id: int,
    prompt_len: int,
    *,
    computed: int | None = None,
    generated: int = 0,
    tenant: str = "t",
    priority: int = 0,
    arrival: float | None = None,
    blocks: int | None = None,
    deadline: float | None = None,
) -> SeqView:
    """A sequence; by default decoding if it has generated tokens, else waiting."""
    if computed is None:
        computed = prompt_len + generated - 1 if generated else 0
    return SeqView(
        seq_id=seq_id,
        tenant=tenant,
        priority=priority,
        arrival=float(seq_id) if arrival is None else arrival,
        prompt_len=prompt_len,
        num_generated=generated,
        num_computed_tokens=computed,
        num_blocks=-(-computed // BLOCK) if blocks is None else blocks,
        deadline=deadline,
    )


def view(
    running: list[SeqView] | tuple[SeqView, ...] = (),
    waiting: list[SeqView] | tuple[SeqView, ...] = (),
    *,
    free: int = 1000,
    cap: int = 512,
    max_seqs: int = 64,
    now: float = 10.0,
    last: tuple[float | None, int] = (None, 0),
    cost: StepCost | None = None,
    admit: int | None = None,
) -> View:
    return View(
        iteration=1,
        now=now,
        running=tuple(running),
        waiting=tuple(dataclasses.replace(s, waiting=True) for s in waiting),
        num_waiting=len(waiting),
        free_blocks=free,
        total_blocks=1000,
        block_size=BLOCK,
        max_batched_tokens=cap,
        max_seqs=max_seqs,
        last_step_ms=last[0],
        last_step_tokens=last[1],
        step_cost=cost,
        admit_blocks=admit,
    )
