"""Speculative decoding, the worker's part: which drafted tokens a step keeps (issue 32).

A sequence with k drafted tokens d_1 .. d_k (Row.drafts) samples at its chunk's
last k + 1 rows: row t's logits give p_t, the distribution of the token at d_{t+1}'s
position (of the token after the drafts, for t = k). The rule is Leviathan et al.'s (Fast
Inference from Transformers via Speculative Decoding, 2023), as vLLM's rejection sampler
applies it: accept d_{t+1} with probability min(1, p_t(d) / q_t(d)), where q_t is the
distribution d was drafted from; at the first rejection draw from max(p_t - q_t, 0)
renormalised; after k acceptances draw one more token from p_k. The tokens then follow the
target distribution exactly, as if decoded one per step.

The service drafts with n-grams of the sequence's own tokens, a deterministic proposer: q_t
is one-hot at d_{t+1}, and the rule reads "accept d with probability p_t(d), and on
rejection draw from p_t without d". The sampler's own draw realises it with one uniform per
position: x_t drawn from p_t (as decoding without drafts draws it, from the same uniform)
equals d with probability p_t(d), and given x_t != d it follows p_t without d. So every
row is sampled as a row without drafts is, and a sequence keeps x_0 .. x_j, j being the
number of leading drafts equal to the token drawn at their position (d_{t+1} = x_t for
t < j): the kept drafts, then the token after them. Greedy rows keep the argmax tokens, the
sampler's tie rules and its bfloat16 refinement (Model.logits) included, and a seeded row
(whose uniform at a position comes from its seed and that position) keeps the very tokens
it takes without drafts. The draft model (gpu_worker.draft_model) drafts greedily, a
deterministic proposer too, so its drafts are verified by the same rule. (Drafts sampled
from a draft model's own q_t would need the sampler's processed p_t as a tensor, the test
above with a uniform and a residual draw with another: a rule of its own.)

Supported: every sampling setting but a grammar: greedy, temperature, top_k, top_p, min_p,
seed, logprobs and top_logprobs, allowed_token_ids, logit_bias, and those that read the
sequence's history (penalties, bad_words, min_tokens: the row after draft t sees the drafts
up to t, and the history keeps the drafts kept; gpu_worker.seq_table). Refused (the step
fails with an error): drafts on a sequence with a grammar's token bitmask, since a plan
carries its grammar's mask for one position only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from gpu_worker.protocol import SamplingSpec, StepPlan, TokenLogprobs
from gpu_worker.sampler import Logits, Sampler
from gpu_worker.seq_table import RowTokens
from gpu_worker.step_inputs import StepInputs

T = TypeVar("T")


@dataclass(slots=True)
class Verification:
    """A step's sampling rows when some sequence has drafts: k + 1 per sampled sequence
    (one for those without), each sequence's in order."""

    drafts: list[list[int]]  # of each sampled sequence, in plan order
    rows: torch.Tensor  # the rows of the flattened batch whose logits sample
    positions: list[int]  # where each sampling row's token sits
    first: list[int]  # each sampled sequence's first sampling row

    @classmethod
    def of(cls, inputs: StepInputs) -> Verification | None:
        """None when no sequence has a draft; ValueError for drafts the step cannot verify."""
        plan = inputs.plan
        check_drafts(plan)
        if not any(row.drafts for row in plan.rows):
            return None
        sampled = inputs.sampled
        drafts = [plan.rows[i].drafts for i in sampled]
        rows: list[int] = []
        positions: list[int] = []
        first: list[int] = []
        last_rows = inputs.last_rows(sampled).tolist()
        for draft, last, end in zip(drafts, last_rows, inputs.ends(sampled), strict=True):
            first.append(len(rows))
            rows += range(last - len(draft), last + 1)
            positions += range(end - len(draft), end + 1)
        return cls(drafts, torch.tensor(rows), positions, first)

    def sample(
        self,
        sampler: Sampler,
        logits: Logits,
        specs: list[SamplingSpec],
        bitmasks: list[torch.Tensor | None] | None,
        history: RowTokens | None,
    ) -> tuple[list[list[int]], TokenLogprobs | None]:
        """Each sampled sequence's kept tokens, and their logprobs (a row per kept token, in
        order) when any row asks. specs and bitmasks have an entry per sampled sequence,
        `history` a row per sampling row (Histories.drafted_rows)."""
        output = sampler.sample(
            logits,
            self._per_row(specs),
            self.positions,
            self._per_row(bitmasks) if bitmasks else None,
            history,
        )
        tokens = [
            drawn[: accepted(draft, drawn) + 1]
            for draft, drawn in zip(self.drafts, self._per_sequence(output.tokens), strict=True)
        ]
        if output.logprobs is None:
            return tokens, None
        kept = [
            first + t
            for first, mine in zip(self.first, tokens, strict=True)
            for t in range(len(mine))
        ]
        return tokens, _rows_of(output.logprobs, kept)

    @property
    def draft_starts(self) -> list[int]:
        """The position of each sampled sequence's first draft (its first row's token)."""
        return [self.positions[first] for first in self.first]

    def _per_row(self, values: list[T]) -> list[T]:
        """A value per sampled sequence -> that value at each of its sampling rows."""
        return [
            v for v, draft in zip(values, self.drafts, strict=True) for _ in range(len(draft) + 1)
        ]

    def _per_sequence(self, values: list[T]) -> list[list[T]]:
        return [
            values[first : first + len(draft) + 1]
            for first, draft in zip(self.first, self.drafts, strict=True)
        ]


def accepted(draft: list[int], drawn: list[int]) -> int:
    """How many drafts a sequence keeps: those before the first that differs from the token
    drawn at its position (drawn[t] is drawn at draft[t]'s position; see the module's rule)."""
    count = 0
    while count < len(draft) and draft[count] == drawn[count]:
        count += 1
    return count


def check_drafts(plan: StepPlan) -> None:
    """ValueError, saying why, for drafts that are not their chunk's last tokens, or on a
    row that does not sample or has a grammar."""
    end = 0
    for row in plan.rows:
        end += row.num_tokens
        draft = row.drafts
        if not draft:
            continue
        seq_id = row.seq_id
        if len(draft) >= row.num_tokens:
            raise ValueError(
                f"sequence {seq_id} has {len(draft)} drafts in a chunk of {row.num_tokens}"
            )
        if plan.input_ids[end - len(draft) : end] != draft:
            raise ValueError(f"sequence {seq_id}'s drafts are not its chunk's last tokens")
        if not row.sample:
            raise ValueError(f"sequence {seq_id} has drafts but does not sample")
        if row.bitmask is not None:
            raise ValueError(f"sequence {seq_id} has drafts and a grammar: not verifiable")


def _rows_of(logprobs: TokenLogprobs, rows: list[int]) -> TokenLogprobs:
    return TokenLogprobs(
        [logprobs.logprobs[r] for r in rows],
        [logprobs.top_ids[r] for r in rows],
        [logprobs.top_logprobs[r] for r in rows],
    )
