"""Each tool-call parser on outputs recorded from its model family (several calls in one
answer, text around them, malformed calls), whole and streamed in random pieces: the
deltas reassembled equal the whole message, as a client sees both."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.chat_output import MessageStream, OutputReader
from service.tool_calls import PARSERS, CallText, parser_named
from service.tool_calls.forced import NamedParser, RequiredParser
from tests.chat_stream_helpers import comparable, reassemble, stream_deltas

WEATHER = CallText("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = CallText("get_time", '{"zone": "Europe/Paris"}')

# (parser, output, expected content, expected calls)
CUT_SHORT = (  # a call cut by max_tokens: what was written of its arguments
    "hermes",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    "",
    [CallText("get_weather", '{"city": "Par')],
)
RECORDED = [
    # Qwen2.5-7B-Instruct, two calls and a preamble
    (
        "hermes",
        "I'll look both up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
        "I'll look both up.\n\n",
        [WEATHER, TIME],
    ),
    # Hermes-3-Llama-3.1-8B: arguments before the name, text after the call
    (
        "hermes",
        '<tool_call>\n{"arguments": {"query": "a \\"quoted\\" </tool_call> word", "n": 3}, '
        '"name": "search"}\n</tool_call>\nSearching now.',
        "\nSearching now.",
        [CallText("search", '{"query": "a \\"quoted\\" </tool_call> word", "n": 3}')],
    ),
    # a block that is not JSON stays text, as vLLM leaves it
    (
        "hermes",
        "Use <tool_call>like this</tool_call> to call.",
        "Use <tool_call>like this</tool_call> to call.",
        [],
    ),
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    # Mistral-7B-Instruct-v0.3
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
        "",
        [WEATHER, TIME],
    ),
    # Mistral-Nemo: text first, one object without the array
    (
        "mistral",
        'Let me check. [TOOL_CALLS] {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}',
        "Let me check. ",
        [TIME],
    ),
    ("mistral", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    # the v11 tokenizer's form (Mistral-Small-3.1, Devstral): name[ARGS]arguments, each call
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Paris"}',
        "",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        'Let me look. [TOOL_CALLS]get_time[ARGS] {"zone": "Europe/Paris"}',
        "Let me look. ",
        [TIME],
    ),
    (
        "mistral",
        "[TOOL_CALLS] is the token, and [TOOL_CALLS]a b[ARGS]{} is no call.",
        "[TOOL_CALLS] is the token, and [TOOL_CALLS]a b[ARGS]{} is no call.",
        [],
    ),
    # Llama-3.1-8B-Instruct after <|python_tag|>, two calls separated by ";"
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
        "",
        [WEATHER, TIME],
    ),
    # Llama-3.2-3B-Instruct: a bare JSON answer
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
        "",
        [TIME],
    ),
    # text before the tag
    (
        "llama3_json",
        'Checking.<|python_tag|>{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
        "Checking.",
        [TIME],
    ),
    (
        "llama3_json",
        '{"answer": 42} is JSON without a name',
        '{"answer": 42} is JSON without a name',
        [],
    ),
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    # Llama-3.2 / ToolACE pythonic list, two calls, text around it
    (
        "pythonic",
        'Sure! [get_weather(city="Paris", unit="celsius"), get_time(zone=\'Europe/Paris\')] Done.',
        "Sure!  Done.",
        [WEATHER, TIME],
    ),
    (
        "pythonic",
        "[search(query=\"a ] b\", limit=5, exact=True, tags=['x', 'y'], extra=None)]",
        "",
        [
            CallText(
                "search",
                '{"query": "a ] b", "limit": 5, "exact": true, "tags": ["x", "y"], "extra": null}',
            )
        ],
    ),
    ("pythonic", "A list [1, 2] and [x for x in y].", "A list [1, 2] and [x for x in y].", []),
    ("pythonic", "[f(x)]", "[f(x)]", []),  # positional: not a call of a declared tool
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_each_parser_reads_its_model_familys_output(name, text, content, calls) -> None:
    parsed = parser_named(name).parse(text, final=True)
    assert (parsed.content, parsed.calls) == (content, calls)
    for call in parsed.calls:
        json.loads(call.arguments)  # whole calls' arguments are JSON


def test_a_call_cut_short_keeps_what_was_written_of_it() -> None:
    name, text, content, calls = CUT_SHORT
    parsed = parser_named(name).parse(text, final=True)
    assert (parsed.content, parsed.calls) == (content, calls)


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from([*RECORDED, CUT_SHORT]), cuts=st.lists(st.integers(0, 400), max_size=30)
)
def test_streamed_in_random_pieces_equals_whole(case, cuts) -> None:
    name, text = case[0], case[1]
    reader = OutputReader(tools=parser_named(name))
    assert reassemble(stream_deltas(reader, text, cuts)) == comparable(reader.message(text))


def test_arguments_stream_in_pieces_after_a_first_delta_naming_the_call() -> None:
    text = RECORDED[0][1]
    stream = MessageStream(OutputReader(tools=parser_named("hermes")))
    deltas = [d for d in (stream.delta(c) for c in text) if "tool_calls" in d]
    first, *rest = [d["tool_calls"][0] for d in deltas if d["tool_calls"][0]["index"] == 0]
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(rest) > 5 and "".join(d["function"]["arguments"] for d in rest) == WEATHER.arguments


def test_parallel_tool_calls_false_returns_only_the_first_call() -> None:
    reader = OutputReader(tools=parser_named("hermes"), max_calls=1)
    message = reader.message(RECORDED[0][1])
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    deltas = stream_deltas(reader, RECORDED[0][1], list(range(0, 400, 7)))
    assert [c["name"] for c in reassemble(deltas)["tool_calls"]] == ["get_weather"]


def test_blank_content_around_calls_is_none() -> None:
    text = next(case[1] for case in RECORDED if case[0] == "mistral")
    message = OutputReader(tools=parser_named("mistral")).message(text)
    assert message["content"] is None and len(message["tool_calls"]) == 2


def test_forced_calls_read_the_grammars_formats() -> None:
    required = (
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}]'
    )
    assert RequiredParser().parse(required, True).calls == [WEATHER, TIME]
    assert NamedParser("get_time").parse(' {"zone": "Europe/Paris"}', True).calls == [TIME]


def test_every_registered_parser_is_covered_by_recordings() -> None:
    assert {case[0] for case in RECORDED} == set(PARSERS)
