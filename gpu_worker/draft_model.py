"""Speculative decoding with a draft model: the worker drafts a step's DRAFT_MODEL_TOKEN
drafts itself, then verifies them as any drafts (gpu_worker.speculation).

The draft model is a second, smaller model of the same vocabulary, with a cache of its own
laid out as the target's: the same blocks, named by the same tables, so a plan's tables
place both models' K/V and the service's block manager serves both. It computes only what
a plan asks (BatchPlan.draft_context): a sequence that does not draft in a step costs it
nothing, so under load, where the service drafts nothing, the draft model does not run.
The service tracks which positions the draft model holds K/V for and sends the rest, in
pieces if need be, before a sequence drafts again.

Drafting is greedy: d_1 is the draft model's argmax after the context and the chunk's
first token, d_t its argmax after d_{t-1}. A deterministic proposer's drafts are verified
exactly by the sampler's own draw (gpu_worker.speculation): greedy and seeded requests
take the tokens they take without drafts, and sampled ones keep their distribution. (A
draft sampled from the draft model's own distribution would be accepted more often at high
temperatures, at the cost of a second sampler rule; vLLM does that. Greedy drafting is
what llama.cpp's speculative server does.)

k drafts take k passes of the draft model: one over every drafting sequence's context and
first token, then one per further draft over the sequences still drafting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_worker.protocol import DRAFT_MODEL_TOKEN, BatchPlan, SamplingSpec

if TYPE_CHECKING:  # the runner holds a Drafter
    from gpu_worker.runner import ModelRunner

_GREEDY = SamplingSpec()


@dataclass(slots=True)
class _Rows:
    """The draft model's rows of one pass: per sequence (an index into the plan) its
    tokens and their first position."""

    seqs: list[int]
    tokens: list[list[int]]
    starts: list[int]
    sample: list[bool]

    def plan(self, target: BatchPlan) -> BatchPlan:
        return BatchPlan(
            step_id=target.step_id,
            seq_ids=[target.seq_ids[i] for i in self.seqs],
            num_tokens=[len(t) for t in self.tokens],
            start_pos=self.starts,
            input_ids=[token for tokens in self.tokens for token in tokens],
            block_tables=[target.block_tables[i] for i in self.seqs],
            sample=self.sample,
            sampling=[_GREEDY] * len(self.seqs),
        )


class Drafter:
    """The draft model's runner, over its own cache (gpu_worker.runtime builds both)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def fill(self, plan: BatchPlan) -> BatchPlan:
        """`plan` with its DRAFT_MODEL_TOKEN drafts chosen by the draft model, which has
        computed the K/V of the context the plan sends and of the rows it read."""
        _check_context(plan)
        wanted = drafts_wanted(plan)
        first = self._first_pass(plan, wanted)
        if first is None:
            return plan
        drafts = self._draft(plan, first, wanted)
        return with_drafts(plan, drafts)

    def _first_pass(self, plan: BatchPlan, wanted: list[int]) -> _Rows | None:
        """The context of each sequence the plan sends it, and the first token of those
        that draft; None when the plan asks nothing of the draft model."""
        context = plan.draft_context or [[] for _ in plan.seq_ids]
        starts = plan.draft_start or [0] * len(plan.seq_ids)
        rows = _Rows([], [], [], [])
        first_row = 0
        for i, tokens in enumerate(context):
            if tokens or wanted[i]:
                head = [plan.input_ids[first_row]] if wanted[i] else []
                if wanted[i] and tokens and starts[i] + len(tokens) != plan.start_pos[i]:
                    raise ValueError(
                        f"sequence {plan.seq_ids[i]} drafts with the draft model, but its "
                        "draft context does not reach its chunk"
                    )
                rows.seqs.append(i)
                rows.tokens.append(tokens + head)
                rows.starts.append(starts[i] if tokens else plan.start_pos[i])
                rows.sample.append(bool(wanted[i]))
            first_row += plan.num_tokens[i]
        return rows if rows.seqs else None

    def _draft(self, plan: BatchPlan, first: _Rows, wanted: list[int]) -> dict[int, list[int]]:
        """Each drafting sequence's (plan index) greedy drafts, one pass per draft."""
        best = self._best(first.plan(plan))
        drafts = {i: [token] for i, token in zip(_sampling(first), best, strict=True)}
        for t in range(1, max(wanted)):
            seqs = [i for i in drafts if wanted[i] > t]
            rows = _Rows(
                seqs,
                [[drafts[i][-1]] for i in seqs],
                [plan.start_pos[i] + t for i in seqs],
                [True] * len(seqs),
            )
            for i, token in zip(seqs, self._best(rows.plan(plan)), strict=True):
                drafts[i].append(token)
        return drafts

    def _best(self, plan: BatchPlan) -> list[int]:
        """The draft model's argmax token after each sampling sequence of `plan`."""
        runner = self.runner
        if not any(plan.sample):
            runner.forward(runner.inputs(plan))  # context only: its K/V is what counts
            return []
        return runner.logits(runner.inputs(plan)).best().tolist()


def _sampling(rows: _Rows) -> list[int]:
    return [i for i, samples in zip(rows.seqs, rows.sample, strict=True) if samples]


def _check_context(plan: BatchPlan) -> None:
    count = len(plan.seq_ids)
    for name in ("draft_context", "draft_start"):
        if getattr(plan, name) and len(getattr(plan, name)) != count:
            raise ValueError(f"plan has {count} seq_ids but {len(getattr(plan, name))} {name}")
    if bool(plan.draft_context) != bool(plan.draft_start):
        raise ValueError("a plan's draft_context and draft_start come together")


def asks_draft_model(plan: BatchPlan) -> bool:
    """Whether the plan sends the draft model context or asks it for drafts."""
    return any(plan.draft_context) or any(drafts_wanted(plan))


def drafts_wanted(plan: BatchPlan) -> list[int]:
    """How many drafts the draft model chooses for each sequence of the plan."""
    if not plan.draft_tokens:
        return [0] * len(plan.seq_ids)
    return [sum(1 for t in draft if t == DRAFT_MODEL_TOKEN) for draft in plan.draft_tokens]


def with_drafts(plan: BatchPlan, drafts: dict[int, list[int]]) -> BatchPlan:
    """`plan` with the drafts of sequences (plan indices) in place of their placeholders."""
    input_ids = list(plan.input_ids)
    draft_tokens = list(plan.draft_tokens)
    end = 0
    for i, count in enumerate(plan.num_tokens):
        end += count
        chosen = drafts.get(i)
        if chosen is None:
            continue
        if len(chosen) != len(draft_tokens[i]):
            raise ValueError(
                f"sequence {plan.seq_ids[i]} mixes drafts of its own with the draft model's"
            )
        input_ids[end - len(chosen) : end] = chosen
        draft_tokens[i] = chosen
    return dataclasses.replace(
        plan, input_ids=input_ids, draft_tokens=draft_tokens, draft_context=[], draft_start=[]
    )
