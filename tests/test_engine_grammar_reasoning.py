"""The reasoning before a grammar (service/engine/grammar_reasoning.py), without a model:
any token until the end marker, the marker forced token by token once the budget is spent,
a reasoning the model opens counted from its opener, and the masks in the plan's bit
layout (bit t of word t // 32)."""

from __future__ import annotations

import base64

import numpy as np

from service.engine.grammar_reasoning import ReasoningPhase, any_token_mask, one_token_mask

END = (700, 33)  # a marker of two tokens


def bits(mask: str) -> set[int]:
    words = np.frombuffer(base64.b64decode(mask), dtype="<u4")
    return {w * 32 + b for w, word in enumerate(words) for b in range(32) if word >> b & 1}


def test_masks_allow_every_token_or_exactly_one() -> None:
    assert bits(any_token_mask(100)) >= set(range(100))
    assert bits(one_token_mask(49152, 40000)) == {40000}


def test_the_reasoning_ends_with_its_marker() -> None:
    phase = ReasoningPhase(END, None, vocab_size=1000)
    assert all(phase.accept(t) for t in (5, 700, 6, 700))
    assert bits(phase.mask()) >= set(range(1000))
    assert not phase.accept(33)


def test_a_spent_budget_forces_the_marker() -> None:
    phase = ReasoningPhase(END, 3, vocab_size=1000)
    assert all(phase.accept(t) for t in (1, 2, 3))
    assert bits(phase.mask()) == {700}
    assert phase.accept(700)
    assert bits(phase.mask()) == {33}
    assert not phase.accept(33)


def test_a_reasoning_the_model_opens_counts_its_budget_from_the_opener() -> None:
    phase = ReasoningPhase(END, 2, opener=9, vocab_size=1000)
    assert phase.declined_by(10) and not phase.declined_by(9)
    assert phase.accept(9) and not phase.declined_by(10)  # opened: every token is its own
    assert phase.accept(1) and bits(phase.mask()) >= set(range(1000))
    assert phase.accept(2) and bits(phase.mask()) == {700}
