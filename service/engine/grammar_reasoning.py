"""A grammar that starts once the reasoning has ended (--reasoning-parser).

A reasoning is opened one of two ways, and in both the grammar waits for its end:
- by the prompt: DeepSeek-R1's template, and Qwen3's thinking ones (Qwen3-*-Thinking-2507),
  end it with `<think>`, so the output begins inside the reasoning;
- by the model: Qwen3's hybrid template (thinking by default) ends its prompt with the
  assistant's turn, and the model writes `<think>` as its first token.
A grammar that constrained the first token would put the JSON in the reasoning and leave
the answer empty (the first way), or forbid the model to think at all (the second). As vLLM
does, the reasoning is free and the grammar begins after its end marker. Where the model
may open it, its first token may be the start marker or one the grammar allows: the start
marker opens the reasoning, any other begins the grammar with it (a model that does not
think answers as constrained from its first token). A prompt that closed the reasoning
(Qwen3's `enable_thinking: false` ends it with `<think>\n\n</think>\n\n`) gets the grammar
from its first token. With a thinking budget (vLLM's `thinking_token_budget`), the end
marker is forced once the reasoning has that many tokens, and the grammar begins then.

The markers are matched as the token ids the tokenizer gives them: one added token each
on the models whose templates think (Qwen3, the R1 distills). A model that spells the end
marker in pieces reasons on, until its budget if it has one; one that spells the start
marker in pieces cannot open a reasoning under a grammar (its pieces are the grammar's).
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
    # the start marker's token, where the model may open the reasoning (its first token);
    # None: the prompt opened it
    opener: int | None = None


@dataclass(slots=True)
class ReasoningPhase:
    """Where a request is in its reasoning: the tokens so far, the marker's progress; or,
    while `opener` is set, before its first token, which may open the reasoning or not."""

    end: tuple[int, ...]
    budget: int | None
    opener: int | None = None
    tokens: int = 0
    tail: tuple[int, ...] = ()  # the last tokens, as long as the marker at most
    forced: int | None = None  # marker tokens forced so far, once the budget is spent
    vocab_size: int = field(default=0)

    def mask(self) -> str:
        """The next token's mask inside the reasoning: any token, or the marker's next one
        once forced. (Before the first token where the model may open it, the mask is the
        grammar's with the opener added: Matcher.opener.)"""
        if self.forced is None:
            return any_token_mask(self.vocab_size)
        return one_token_mask(self.vocab_size, self.end[self.forced])

    def declined_by(self, token: int) -> bool:
        """`token` is a first token that does not open the reasoning: the grammar's."""
        return self.opener is not None and token != self.opener

    def accept(self, token: int) -> bool:
        """Take the sampled `token` (the opener, or one inside the reasoning); False once
        the reasoning has ended with it."""
        if self.opener is not None:  # it opens the reasoning: its tokens count from here
            self.opener = None
            return True
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
