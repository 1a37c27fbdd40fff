"""A grammar that starts once the reasoning has ended (--reasoning-parser).

A prompt that opens the reasoning (DeepSeek-R1's template ends it with `<think>`) leaves
the output inside it. A grammar that constrained the first token would put the JSON in
the reasoning and leave the answer empty; as vLLM does, the reasoning is free and the
grammar begins after its end marker. With a thinking budget (vLLM's
`thinking_token_budget`), the marker is forced once the reasoning has that many tokens, and
the grammar begins then.

The marker is matched as the token ids the tokenizer gives it: one special token on the
models whose templates think (Qwen3, the R1 distills); a model that spells it in other
pieces reasons on, until its budget if it has one.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class AfterReasoning:
    """A compiled grammar, to start after the reasoning's `end` marker (token ids)."""

    compiled: Any
    end: tuple[int, ...]
    budget: int | None = None  # reasoning tokens before the marker is forced; None: no bound


@dataclass(slots=True)
class ReasoningPhase:
    """Where a request is in its reasoning: the tokens so far, the marker's progress."""

    end: tuple[int, ...]
    budget: int | None
    tokens: int = 0
    tail: tuple[int, ...] = ()  # the last tokens, as long as the marker at most
    forced: int | None = None  # marker tokens forced so far, once the budget is spent
    vocab_size: int = field(default=0)

    def mask(self) -> str:
        """The next token's mask: any token, or the marker's next one once forced."""
        if self.forced is None:
            return any_token_mask(self.vocab_size)
        return one_token_mask(self.vocab_size, self.end[self.forced])

    def accept(self, token: int) -> bool:
        """Take the sampled `token`; False once the reasoning has ended with it."""
        self.tokens += 1
        if self.forced is not None:
            self.forced += 1
            return self.forced < len(self.end)
        self.tail = (*self.tail, token)[-len(self.end) :]
        if self.tail == self.end:
            return False
        if self.budget is not None and self.tokens >= self.budget:
            self.forced = 0
        return True


def _packed(words: np.ndarray) -> str:
    return base64.b64encode(np.asarray(words, dtype="<i4").tobytes()).decode("ascii")


@cache
def any_token_mask(vocab_size: int) -> str:
    return _packed(np.full(-(-vocab_size // 32), -1, dtype="<i4"))


@cache
def one_token_mask(vocab_size: int, token: int) -> str:
    words = np.zeros(-(-vocab_size // 32), dtype="<u4")
    words[token // 32] = np.uint32(1) << np.uint32(token % 32)
    return _packed(words.view("<i4"))
