"""Tool calls and reasoning on a real server (the default model) with the official openai
client: tool_choice `required` and a named function give arguments that fit the tool's
schema, greedy and sampled, whole and streamed (the deltas reassembled equal the whole);
an agent's two turns (a call, its result, the answer) through the client's own types;
`auto` read by the hermes parser; reasoning opened by chat_template_kwargs and returned as
reasoning_content; continuous usage stats; /version; and the 400s of bad tool requests.
The Responses API and Anthropic's Messages API (its official SDK) call tools and think on
the same server.

The server runs with --chat-template (SmolLM2's own template shows no tools), so the flag
is tested too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.chat_stream_helpers import comparable, reassemble
from tests.server_fixtures import RunningServer, start_server, stop_server

pytestmark = pytest.mark.real_model
TEMPLATE = Path(__file__).with_name("hermes_template.jinja")
MAX_TOKENS = 96  # a call of these tools takes up to ~75 tokens
CITY = {"type": "string", "minLength": 1, "maxLength": 20}


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


WEATHER = tool(
    "get_weather",
    "The current weather in a city",
    {"city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}},
    ["city", "unit"],
)
ADD = tool(
    "add",
    "Add two integers",
    {
        "a": {"type": "integer", "minimum": -999, "maximum": 999},
        "b": {"type": "integer", "minimum": -999, "maximum": 999},
    },
    ["a", "b"],
)
FLIGHT = tool(
    "book_flight",
    "Book a flight between two airports",
    {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "flexible": {"type": "boolean"},
    },
    ["origin", "destination", "passengers", "flexible"],
)
TAGS = tool(
    "tag_note",
    "Tag a note",
    {
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        }
    },
    ["tags"],
)
ALL_TOOLS = [WEATHER, ADD, FLIGHT, TAGS]
# (question, tools offered, tool_choice, temperature): required greedy, a named function
# sampled (the grammar holds under sampling), each over all four tools
FORCED_CASES = [
    ("What is the weather like in Paris?", ALL_TOOLS, "required", 0.0),
    ("I need a flight to Rome next week.", ALL_TOOLS, "book_flight", 0.9),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("tools-server"),
        "--chat-template",
        str(TEMPLATE),
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "deepseek_r1",
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def choice_of(name: str) -> Any:
    if name == "required":
        return name
    return {"type": "function", "function": {"name": name}}


def ask(client: openai.OpenAI, question: str, stream: bool, **fields: Any) -> Any:
    fields.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": question}],
        seed=7,
        stream=stream,
        **fields,
    )


def streamed(chunks: Any) -> tuple[dict, str | None]:
    """(the message the deltas add up to, the finish reason)."""
    deltas, finish = [], None
    for chunk in chunks:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.model_dump(exclude_none=True))
            finish = chunk.choices[0].finish_reason or finish
    return reassemble(deltas), finish


def check_fits(message: Any, tools: list[dict], choice: str) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert choice in ("required", call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize(("question", "tools", "choice", "temperature"), FORCED_CASES)
def test_forced_calls_fit_their_tools_schema_whole_and_streamed(
    client: openai.OpenAI, question: str, tools: list[dict], choice: str, temperature: float
) -> None:
    fields = {"tools": tools, "tool_choice": choice_of(choice), "temperature": temperature}
    whole = ask(client, question, False, **fields).choices[0]
    assert whole.finish_reason == "tool_calls"
    check_fits(whole.message, tools, choice)
    message, finish = streamed(ask(client, question, True, **fields))
    assert finish == "tool_calls"
    assert message == comparable(whole.message.model_dump())  # seeded: the same tokens


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    fields = {"tools": ALL_TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    message = ask(client, "Weather in Lima and Kyiv?", False, **fields)
    assert len(message.choices[0].message.tool_calls) == 1


def test_an_agent_loop_of_two_turns(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Madrid?"}]
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    messages.append(first.choices[0].message)  # the client's own type, content None
    result = {"temperature": 31, "unit": "celsius", "sky": "clear"}
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    second = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # the call and its result were rendered into the second prompt
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_auto_is_read_by_the_hermes_parser_whole_and_streamed(client: openai.OpenAI) -> None:
    fields = {"tools": ALL_TOOLS, "temperature": 0, "max_tokens": 16}
    question = "Please call the weather tool for Berlin."
    whole = ask(client, question, False, **fields).choices[0]
    message, finish = streamed(ask(client, question, True, **fields))
    assert message == comparable(whole.message.model_dump())
    assert finish == whole.finish_reason
    assert (whole.finish_reason == "tool_calls") == bool(whole.message.tool_calls)
    assert "<tool_call>" not in (whole.message.content or "")


def test_reasoning_opened_by_the_template_is_reasoning_content(client: openai.OpenAI) -> None:
    fields = {
        "temperature": 0.9,  # seeded: the stream samples the same tokens
        "max_tokens": 16,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
    }
    whole = ask(client, "Why is the sky blue?", False, **fields).choices[0].message
    # the prompt ends inside <think>: what the model writes before </think> is reasoning
    assert whole.model_dump()["reasoning_content"] and whole.content is None
    message, _ = streamed(ask(client, "Why is the sky blue?", True, **fields))
    assert message == comparable(whole.model_dump())
    plain = ask(client, "Why is the sky blue?", False, max_tokens=8).choices[0].message
    assert plain.model_dump()["reasoning_content"] is None and plain.content


def test_continuous_usage_stats_count_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        ask(
            client,
            "Count to five.",
            True,
            max_tokens=12,
            temperature=0,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert all(chunk.usage is not None for chunk in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 12
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {chunks[-1].usage.prompt_tokens}


def test_version(server: RunningServer) -> None:
    body = httpx.get(f"{server.url}/version", timeout=10).json()
    assert isinstance(body["version"], str) and body["version"]


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": choice_of("nowhere")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [USER, {"role": "tool", "content": "18 C"}]}, "messages[1]"),
        (
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{x"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0]",
        ),
        ({"messages": [USER, {"role": "assistant"}]}, "messages[1]"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"reasoning_effort": "maximal"}, "reasoning_effort"),
        (
            {"tools": [tool("f", "", {"x": {"type": "nonsense"}}, [])], "tool_choice": "required"},
            "tools",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    server: RunningServer, fields: dict, param: str
) -> None:
    body = {"model": server.model, "messages": [USER], "max_tokens": 4, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_renders_a_chat_as_generation_does(
    client: openai.OpenAI, server: RunningServer
) -> None:
    fields = {"tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": True}}
    body = {"model": server.model, "messages": [USER], **fields}
    counted = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["count"]
    answer = client.chat.completions.create(
        model=server.model,
        messages=[USER],
        max_tokens=1,
        tool_choice="none",
        tools=fields["tools"],
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert counted == answer.usage.prompt_tokens
    plain = httpx.post(f"{server.url}/tokenize", json={"messages": [USER]}, timeout=30).json()
    assert plain["count"] < counted - 50  # without the tools' system turn


def responses_tool(chat_tool: dict) -> dict:
    return {"type": "function", **chat_tool["function"]}


def test_the_responses_api_whole_and_streamed(client: openai.OpenAI) -> None:
    fields = {
        "model": "SmolLM2-135M-Instruct",
        "max_output_tokens": 16,
        "temperature": 0,
        "instructions": "Answer briefly.",
        "input": "What is the capital of France?",
    }
    whole = client.responses.create(**fields)
    assert whole.object == "response" and whole.output_text
    assert whole.status in ("completed", "incomplete") and whole.usage.output_tokens <= 16
    events = list(client.responses.create(**fields, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text


def test_the_responses_api_calls_tools_and_takes_their_output(client: openai.OpenAI) -> None:
    tools = [responses_tool(WEATHER), responses_tool(ADD)]
    items: list[Any] = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    events = list(
        client.responses.create(
            model="SmolLM2-135M-Instruct",
            input=items,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    first = events[-1].response
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(
        json.loads(call.arguments), {t["name"]: t["parameters"] for t in tools}[call.name]
    )
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == call.arguments
    items += [
        call,
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 24}'},
    ]
    second = client.responses.create(
        model="SmolLM2-135M-Instruct",
        input=items,
        tools=tools,
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens


CITY_FORMAT = {
    "type": "json_schema",
    "name": "city",
    "schema": {
        "type": "object",
        "properties": {"city": CITY, "country": CITY},
        "required": ["city", "country"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_the_responses_api_keeps_its_text_format_and_logprobs(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "input": "Name a city and its country.",
        "max_output_tokens": 48,
        "temperature": 0,
        "text": {"format": CITY_FORMAT},
        "top_logprobs": 2,
    }
    whole = client.responses.create(**fields)
    jsonschema.validate(json.loads(whole.output_text), CITY_FORMAT["schema"])
    assert whole.text.format.type == "json_schema" and whole.text.format.name == "city"
    part = whole.output[-1].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    events = list(client.responses.create(**fields, stream=True))
    assert events[-1].response.output_text == whole.output_text
    streamed = [p for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
    assert [p.token for p in streamed] == [p.token for p in part.logprobs]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning"),
        ({"n": 2}, "n"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_responses_fields_it_cannot_honour_are_400s_naming_them(
    server: RunningServer, fields: dict, param: str
) -> None:
    body = {"input": "hi", "max_output_tokens": 4, **fields}
    answer = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_grammar_starts_after_the_reasoning_whole_and_streamed(client: openai.OpenAI) -> None:
    """The template opens `<think>` (enable_thinking): the reasoning is free, and the schema
    binds the answer after it; a thinking_token_budget of 8 ends it (the marker forced)."""
    fields: dict[str, Any] = {
        "response_format": {"type": "json_schema", "json_schema": {**CITY_FORMAT}},
        "max_tokens": 64,
        "temperature": 0,
        "extra_body": {
            "chat_template_kwargs": {"enable_thinking": True},
            "thinking_token_budget": 8,
        },
    }
    fields["response_format"]["json_schema"].pop("type")
    whole = ask(client, "Name a city and its country.", False, **fields).choices[0].message
    thought = whole.model_extra["reasoning_content"]
    assert thought and not thought.lstrip().startswith("{")  # free text, not the JSON
    jsonschema.validate(json.loads(whole.content), CITY_FORMAT["schema"])
    message, _ = streamed(ask(client, "Name a city and its country.", True, **fields))
    assert message == comparable(whole.model_dump())
    fields["extra_body"]["include_reasoning"] = False
    hidden = ask(client, "Name a city and its country.", False, **fields).choices[0].message
    assert hidden.content == whole.content and not hidden.model_extra.get("reasoning_content")


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    """Anthropic's SDK, pointed at the server as ANTHROPIC_BASE_URL points it."""
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def anthropic_tool(chat_tool: dict) -> dict:
    function = chat_tool["function"]
    return {k: function[k] for k in ("name", "description")} | {
        "input_schema": function["parameters"]
    }


def test_the_messages_api_tool_loop(claude: anthropic.Anthropic) -> None:
    """tool_use (forced by naming the tool: its arguments only, few tokens; streamed) then
    tool_result, answered with `auto` (the hermes parser reads the answer); count_tokens
    counts the prompt the tools are in."""
    tools = [anthropic_tool(ADD)]  # a short call: few tokens to generate
    messages: list[Any] = [{"role": "user", "content": "What is 10 plus 20?"}]
    fields: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "tools": tools,
        "extra_body": {"temperature": 0},
    }
    with claude.messages.stream(
        **fields,
        messages=messages,
        max_tokens=MAX_TOKENS,
        tool_choice={"type": "tool", "name": "add"},
    ) as stream:
        events = [event for event in stream if event.type.startswith("content_block")]
        first = stream.get_final_message()
    (call,) = first.content
    assert call.type == "tool_use" and first.stop_reason == "tool_use"
    jsonschema.validate(call.input, ADD["function"]["parameters"])
    assert events[0].content_block.model_dump(include={"type", "id", "name", "input"}) == {
        "type": "tool_use", "id": call.id, "name": "add", "input": {}
    }  # fmt: skip
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(pieces)) == call.input
    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "30"}],
        },
    ]
    second = claude.messages.create(**fields, messages=messages, max_tokens=8)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert [block.type == "tool_use" for block in second.content].count(True) == (
        second.stop_reason == "tool_use"
    )
    assert all("<tool_call>" not in getattr(block, "text", "") for block in second.content)
    # the call and its result were rendered into the second prompt
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    counted = claude.messages.count_tokens(model=fields["model"], tools=tools, messages=messages)
    assert counted.input_tokens == second.usage.input_tokens


def test_the_messages_api_thinking_block_whole_and_streamed(claude: anthropic.Anthropic) -> None:
    fields: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "extra_body": {"temperature": 0},
    }
    # the template opens <think>: what comes before </think> is the thinking block
    whole = claude.messages.create(**fields, thinking={"type": "adaptive"})
    assert whole.content[0].type == "thinking" and whole.content[0].thinking.strip()
    with claude.messages.stream(**fields, thinking={"type": "adaptive"}) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    thinking = "".join(d.thinking for d in deltas if d.type == "thinking_delta")
    assert thinking == whole.content[0].thinking
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    plain = claude.messages.create(**fields, thinking={"type": "disabled"})
    assert [block.type for block in plain.content] == ["text"]
