"""The service's mirror of what the worker holds, and the step plans written from it.

The scheduler decides a step (who runs, how many tokens, which blocks, the drafts); the
PlanBuilder describes it to the worker as the wire wants it (gpu_worker.protocol.StepPlan):
a sequence is introduced once, with the first plan that runs it (its SamplingSpec, prompt
length, pooling, and the prefix its history starts from when its sampling reads one), and
afterwards its row carries only what changed: its tokens, start position, the block ids
its tables gained since its last row, its drafts, mask and prompt targets. A sequence that
ends, is aborted or preempted is forgotten (`forget`): the next plan lists it in
`finished`, and a preempted one is introduced again when it runs again. A new worker holds
nothing: `reset` on every worker start.

Blocks. The builder remembers how many table entries the worker holds of each sequence;
a row sends the entries from there on. Entries are given back only after a step with
drafts (BlockManager.trim: a sequence keeps the blocks of its computed tokens); `fold`
reads the table after the step's result, and the next row says where the trimmed table
ends (Row.blocks_at), so the worker writes over whatever it held past it.

Results. `fold` also takes what a step returned beside its tokens: a chunk's prompt
log-probabilities (once each: a recomputed chunk computes some again), a chunk's pooled
vector (embeddings), and what the worker's draft model now holds K/V for: a mirror of the
worker's cache too, so a preempted sequence's starts again at 0.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from gpu_worker.protocol import (
    DRAFT_MODEL_TOKEN,
    POOL_LAST,
    POOL_SUM,
    NewSeq,
    Row,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from service.engine.block_manager import BlockManager
from service.engine.request import MEAN_POOLING, Request
from service.engine.step import Scheduled


@dataclass(slots=True)
class _Held:
    """What the worker holds of one sequence: its tables' length, and how far its draft
    model's cache reaches."""

    entries: int = 0
    # entries were given back since its last row: the worker holds more than `entries`
    rewound: bool = False
    draft_synced: int = 0  # positions 0 .. draft_synced - 1 have K/V in the draft model's cache


class PlanBuilder:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._held: dict[int, _Held] = {}  # by seq_id: the sequences the worker holds
        self._finished: list[int] = []  # forgotten since the last plan

    def reset(self, blocks: BlockManager) -> None:
        """A new worker, with a fresh cache: it holds nothing."""
        self.blocks = blocks
        self._held.clear()
        self._finished.clear()

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._held

    def draft_synced(self, seq_id: int) -> int:
        """The positions the worker's draft model holds K/V for (speculative decoding with
        a draft model: service.engine.speculation sends it the rest first)."""
        held = self._held.get(seq_id)
        return 0 if held is None else held.draft_synced

    def forget(self, seq_id: int) -> None:
        """The sequence ended, or was preempted: the next plan tells the worker."""
        if self._held.pop(seq_id, None) is not None:
            self._finished.append(seq_id)

    def build(self, scheduled: list[Scheduled], step_id: int) -> StepPlan:
        """The plan of a step's scheduled rows, in order."""
        new: list[NewSeq] = []
        rows: list[Row] = []
        input_ids: list[int] = []
        for item in scheduled:
            request = item.request
            start = request.num_computed_tokens
            if request.seq_id not in self._held:
                new.append(_introduction(request, start))
                self._held[request.seq_id] = _Held()
            rows.append(self._row(item, start))
            input_ids += request.token_ids[start : start + item.num_tokens]
            input_ids += item.drafts
        finished, self._finished = self._finished, []
        return StepPlan(step_id, rows, input_ids, new=new, finished=finished)

    def fold(self, item: Scheduled, row: int, result: StepResult, accepted: int) -> None:
        """What the step (its `row`) returned for `item` beside its tokens, once its
        progress is committed; `accepted`: the drafts it kept."""
        request = item.request
        start = item.start
        if result.prompt_logprobs:
            _keep_prompt_logprobs(request, start, result.prompt_logprobs[row])
        if result.pooled:
            _keep_pooled(request, start, result.pooled[row])
        held = self._held.get(request.seq_id)
        if held is not None:
            held.draft_synced = _draft_synced(item, start, accepted, held.draft_synced)
        if held is not None and item.drafts:  # blocks past the kept drafts were given back
            entries = len(self.blocks.table(request.seq_id))
            if entries < held.entries:
                held.entries, held.rewound = entries, True

    def _row(self, item: Scheduled, start: int) -> Row:
        request = item.request
        held = self._held[request.seq_id]
        tables = [self.blocks.table(request.seq_id, g) for g in range(self.blocks.num_groups)]
        at = held.entries
        added = [table[at:] for table in tables] if len(tables[0]) > at else []
        rewound, held.rewound = held.rewound, False
        if added:
            held.entries = len(tables[0])
        grammar = request.grammar if item.samples else None
        return Row(
            request.seq_id,
            item.chunk,
            start,
            blocks=added,
            blocks_at=at if rewound else None,  # None: where the worker's table ends
            sample=item.samples,
            drafts=item.drafts,
            draft_context=item.draft_context,
            draft_start=item.draft_start,
            bitmask=None if grammar is None else grammar.mask,
            prompt_targets=_prompt_targets(request, item.num_tokens),
        )


def _introduction(request: Request, start: int) -> NewSeq:
    """A sequence's first plan on the worker: from `start` (past a prefix-cache hit)."""
    sampling = request.params.sampling
    prefix = request.token_ids[:start] if sampling.reads_history else []
    return NewSeq(
        request.seq_id,
        sampling,
        request.prompt_len,
        prefix,
        _pooling(request),
        request.params.adapter,
    )


def _pooling(request: Request) -> str | None:
    """What the worker pools of the sequence (NewSeq.pooling): every row's sum for a mean,
    the last row of its prompt for the last token's state."""
    kind = request.params.pooling
    if kind is None:
        return None
    return POOL_SUM if kind == MEAN_POOLING else POOL_LAST


def _prompt_targets(request: Request, num_tokens: int) -> list[int] | None:
    """The prompt tokens a chunk's positions predict, when the request wants them."""
    if not request.needs_prompt_logprobs:
        return None
    start = request.num_computed_tokens
    return request.token_ids[start + 1 : min(start + 1 + num_tokens, request.prompt_len)] or None


def _draft_synced(item: Scheduled, start: int, accepted: int, synced: int) -> int:
    """What the draft model's cache holds once the step ran (it held `synced`): the context
    sent, and the rows it drafted from that the sequence keeps (gpu_worker.draft_model)."""
    if item.drafts and item.drafts[0] == DRAFT_MODEL_TOKEN:
        return start + 1 + min(accepted, len(item.drafts) - 1)
    if item.draft_context:
        return item.draft_start + len(item.draft_context)
    return synced


def _keep_pooled(request: Request, start: int, found: str | None) -> None:
    """Adds a chunk's pooled vector to what `request` has. A mean pooled request takes no
    prefix-cache hit, so its computation (again, after a preemption) starts at 0."""
    if found is None:
        return
    vector = np.frombuffer(base64.b64decode(found), dtype="<f8")
    if start == 0 or request.pooled is None or request.params.pooling != MEAN_POOLING:
        request.pooled = vector.tolist()
    else:
        request.pooled = (np.asarray(request.pooled) + vector).tolist()


def _keep_prompt_logprobs(request: Request, first: int, found: TokenLogprobs | None) -> None:
    """Adds a chunk's prompt log-probabilities to what `request` has, once each: a request
    recomputed after a preemption computes some again. `first`: the chunk's first
    position, whose target is the token after it."""
    if found is None or request.prompt_logprobs is None:
        return
    known = len(request.prompt_logprobs)
    if first > known:
        return  # cannot happen: such a request takes no prefix-cache hit
    skip = known - first
    request.prompt_logprobs.extend(
        TokenLogprobs(found.logprobs[skip:], found.top_ids[skip:], found.top_logprobs[skip:])
    )
