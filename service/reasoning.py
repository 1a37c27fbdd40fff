"""Reasoning read out of a model's text (--reasoning-parser): the `<think>...</think>` of
Qwen3, QwQ and the DeepSeek-R1 distills, returned as `reasoning_content` beside the answer.

As the tool-call parsers (service.tool_calls), `parse(text, final)` on a growing text says
only what later text cannot change, so streamed deltas add up to the whole parse. A
template may open the reasoning itself (DeepSeek-R1's and Qwen3-Thinking-2507's end their
prompt with `<think>`; Qwen3's hybrid one leaves it to the model, or closes it, empty, for
`enable_thinking: false`): then the output begins inside it, and `starts_inside` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.tool_calls.parsed import content_before

START = "<think>"
END = "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # the same tags: names as vLLM's, for its users' flags


@dataclass(slots=True)
class Reasoned:
    reasoning: str | None  # None: the output does not reason
    content: str


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending with `prompt_tail` leaves its output inside the reasoning."""
    return prompt_tail.rstrip().endswith(START)


def closes_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending with `prompt_tail` closed the reasoning: the output answers."""
    return prompt_tail.rstrip().endswith(END)


def parse(text: str, final: bool, starts_inside: bool) -> Reasoned:
    if not starts_inside:
        begins = text.lstrip()
        if not final and START.startswith(begins):
            return Reasoned(None, "")  # blank, or the start of the tag: undecided
        if not begins.startswith(START):
            return Reasoned(None, text)
        text = begins[len(START) :]
    reasoning, after = content_before(text, END, final)
    if after is None:
        return Reasoned(reasoning, "")
    return Reasoned(reasoning, text[after:])
