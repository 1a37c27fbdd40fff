"""Speculative decoding with a draft model: the worker drafts a step's DRAFT_MODEL_TOKEN
drafts itself, then verifies them as any drafts (gpu_worker.speculation).

The draft model is a second, smaller model of the same vocabulary, with a cache of its own
laid out as the target's: the same blocks, named by the same tables, so a plan's tables
place both models' K/V and the service's block manager serves both. It computes only what
a plan asks (Row.draft_context): a sequence that does not draft in a step costs it
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
from typing import Protocol

import torch

from gpu_worker.protocol import DRAFT_MODEL_TOKEN, Row, StepPlan
from gpu_worker.sampler import Logits
from gpu_worker.seq_table import SeqTable
from gpu_worker.step_inputs import StepInputs


class DraftRunner(Protocol):
    """What a Drafter needs of the draft model's runner (a ModelRunner, which holds the
    Drafter of its target: this, not the runner's class, keeps the two modules apart)."""

    table: SeqTable

    def inputs(self, plan: StepPlan) -> StepInputs: ...

    def forward(self, inputs: StepInputs) -> torch.Tensor: ...

    def logits(self, inputs: StepInputs) -> Logits: ...


@dataclass(slots=True)
class _Rows:
    """The draft model's rows of one pass: per sequence (an index into the plan) its
    tokens and their first position."""

    seqs: list[int]
    tokens: list[list[int]]
    starts: list[int]
    sample: list[bool]

    def plan(self, target: StepPlan) -> StepPlan:
        """The pass as a plan of the sequences the target's plan introduced: the draft
        model's runner shares the target's table, so its rows add no blocks."""
        rows = [
            Row(target.rows[i].seq_id, len(tokens), start, sample=sample)
            for i, tokens, start, sample in zip(
                self.seqs, self.tokens, self.starts, self.sample, strict=True
            )
        ]
        return StepPlan(target.step_id, rows, [t for tokens in self.tokens for t in tokens])


class Drafter:
    """The draft model's runner, over its own cache (gpu_worker.runtime builds both)."""

    def __init__(self, runner: DraftRunner) -> None:
        self.runner = runner

    def fill(self, plan: StepPlan) -> StepPlan:
        """`plan` (applied to the table already) with its DRAFT_MODEL_TOKEN drafts chosen
        by the draft model, which has computed the K/V of the context the plan sends and
        of the rows it read."""
        wanted = drafts_wanted(plan)
        first = self._first_pass(plan, wanted)
        if first is None:
            return plan
        drafts = self._draft(plan, first, wanted)
        return with_drafts(plan, drafts)

    def _first_pass(self, plan: StepPlan, wanted: list[int]) -> _Rows | None:
        """The context of each sequence the plan sends it, and the first token of those
        that draft; None when the plan asks nothing of the draft model."""
        rows = _Rows([], [], [], [])
        first_row = 0
        for i, row in enumerate(plan.rows):
            tokens = row.draft_context
            if tokens or wanted[i]:
                head = [plan.input_ids[first_row]] if wanted[i] else []
                if wanted[i] and tokens and row.draft_start + len(tokens) != row.start_pos:
                    raise ValueError(
                        f"sequence {row.seq_id} drafts with the draft model, but its "
                        "draft context does not reach its chunk"
                    )
                rows.seqs.append(i)
                rows.tokens.append(tokens + head)
                rows.starts.append(row.draft_start if tokens else row.start_pos)
                rows.sample.append(bool(wanted[i]))
            first_row += row.num_tokens
        return rows if rows.seqs else None

    def _draft(self, plan: StepPlan, first: _Rows, wanted: list[int]) -> dict[int, list[int]]:
        """Each drafting sequence's (plan index) greedy drafts, one pass per draft."""
        best = self._best(first.plan(plan))
        drafts = {i: [token] for i, token in zip(_sampling(first), best, strict=True)}
        for t in range(1, max(wanted)):
            seqs = [i for i in drafts if wanted[i] > t]
            rows = _Rows(
                seqs,
                [[drafts[i][-1]] for i in seqs],
                [plan.rows[i].start_pos + t for i in seqs],
                [True] * len(seqs),
            )
            for i, token in zip(seqs, self._best(rows.plan(plan)), strict=True):
                drafts[i].append(token)
        return drafts

    def _best(self, plan: StepPlan) -> list[int]:
        """The draft model's argmax token after each sampling sequence of `plan`."""
        runner = self.runner
        if not plan.sampled_ids:
            runner.forward(runner.inputs(plan))  # context only: its K/V is what counts
            return []
        return runner.logits(runner.inputs(plan)).best().tolist()


def _sampling(rows: _Rows) -> list[int]:
    return [i for i, samples in zip(rows.seqs, rows.sample, strict=True) if samples]


def asks_draft_model(plan: StepPlan) -> bool:
    """Whether the plan sends the draft model context or asks it for drafts."""
    return any(row.draft_context for row in plan.rows) or any(drafts_wanted(plan))


def drafts_wanted(plan: StepPlan) -> list[int]:
    """How many drafts the draft model chooses for each row of the plan."""
    return [row.drafts.count(DRAFT_MODEL_TOKEN) for row in plan.rows]


def with_drafts(plan: StepPlan, drafts: dict[int, list[int]]) -> StepPlan:
    """`plan` with the drafts of rows (plan indices) in place of their placeholders, and
    no draft context left (the draft model computed it)."""
    input_ids = list(plan.input_ids)
    rows = []
    end = 0
    for i, row in enumerate(plan.rows):
        end += row.num_tokens
        chosen = drafts.get(i)
        if chosen is None:
            rows.append(dataclasses.replace(row, draft_context=[], draft_start=0))
            continue
        if len(chosen) != len(row.drafts):
            raise ValueError(
                f"sequence {row.seq_id} mixes drafts of its own with the draft model's"
            )
        input_ids[end - len(chosen) : end] = chosen
        rows.append(dataclasses.replace(row, drafts=chosen, draft_context=[], draft_start=0))
    return dataclasses.replace(plan, rows=rows, input_ids=input_ids, new=[], finished=[])
