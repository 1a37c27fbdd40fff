"""The <think> reasoning parser on Qwen3 and DeepSeek-R1-style outputs, whole and streamed
in random pieces (the deltas reassembled equal the whole message), alone and before tool
calls."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service import reasoning
from service.api.chat_output import OutputReader
from service.tool_calls import parser_named
from tests.chat_stream_helpers import comparable, reassemble, stream_deltas

# (output, the prompt opened the reasoning, expected reasoning, expected content)
RECORDED = [
    # Qwen3-8B, thinking on: the output opens the reasoning itself
    (
        "<think>\nThe user asks for the capital of France. That is Paris.\n</think>\n\n"
        "The capital of France is **Paris**.",
        False,
        "\nThe user asks for the capital of France. That is Paris.\n",
        "\n\nThe capital of France is **Paris**.",
    ),
    # Qwen3 with enable_thinking false: no reasoning at all
    ("The capital of France is Paris.", False, None, "The capital of France is Paris."),
    # DeepSeek-R1-Distill-Qwen: the template ends the prompt with "<think>\n"
    (
        "Okay, 2 + 2 is 4.\n</think>\n\n**Answer:** 4",
        True,
        "Okay, 2 + 2 is 4.\n",
        "\n\n**Answer:** 4",
    ),
    # cut short by max_tokens while reasoning
    ("<think>Let me think about primes: 2, 3, 5", False, "Let me think about primes: 2, 3, 5", ""),
    ("Hmm, a <thought> is not a tag.", False, None, "Hmm, a <thought> is not a tag."),
]
HERMES_AFTER_THINKING = (
    "<think>I need the weather tool.</think>\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


@pytest.mark.parametrize(("text", "inside", "thought", "content"), RECORDED)
def test_reasoning_is_split_from_the_answer(text, inside, thought, content) -> None:
    assert reasoning.parse(text, True, inside) == reasoning.Reasoned(thought, content)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(RECORDED), cuts=st.lists(st.integers(0, 200), max_size=25))
def test_streamed_reasoning_equals_whole(case, cuts) -> None:
    reader = OutputReader(reasons=True, starts_inside=case[1])
    assert reassemble(stream_deltas(reader, case[0], cuts)) == comparable(reader.message(case[0]))


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=25))
def test_reasoning_then_a_tool_call_streamed_equals_whole(cuts) -> None:
    reader = OutputReader(reasons=True, tools=parser_named("hermes"))
    whole = reader.message(HERMES_AFTER_THINKING)
    assert whole["reasoning_content"] == "I need the weather tool."
    assert whole["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert whole["content"] is None
    assert reassemble(stream_deltas(reader, HERMES_AFTER_THINKING, cuts)) == comparable(whole)


@pytest.mark.parametrize(
    ("tail", "inside"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n", False),
        ("<think>\n\n</think>\n\n", False),
    ],
)
def test_a_prompt_that_opens_the_reasoning_is_seen(tail, inside) -> None:
    assert reasoning.opens_reasoning(tail) is inside


@settings(max_examples=20, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=25))
def test_include_reasoning_false_leaves_the_reasoning_out_whole_and_streamed(cuts) -> None:
    text = RECORDED[0][0]
    reader = OutputReader(reasons=True, shows_reasoning=False)
    whole = reader.message(text)
    assert "reasoning_content" not in whole and whole["content"] == RECORDED[0][3]
    deltas = stream_deltas(reader, text, cuts)
    assert not any("reasoning_content" in delta for delta in deltas)
    assert reassemble(deltas) == comparable(whole)
