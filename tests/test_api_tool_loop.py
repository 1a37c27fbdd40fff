"""The tool loop agents run, with the official openai client, on the default model with its
own chat template and `--tool-call-parser hermes`: a call forced by `required`, one by a
named function, `auto` read by the parser, then the turn that sends the call back (the
client's own message, `content: None`) with the tool's result, answered in text.

SmolLM2's template knows no tools and concatenated the null content: "can only concatenate
str (not "NoneType") to str". The messages are now shown to such a template as text
(service/chat_messages.py). (The other bundled model, Gemma 3 270M, comes with no chat
template; the hermes template of tests/test_api_tools.py renders the calls itself.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server_fixtures import RunningServer, served
from tests.test_api_tools import MAX_TOKENS, WEATHER, choice_of

pytestmark = pytest.mark.real_model
QUESTION = "What is the weather in Madrid?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from served(tmp_path_factory, "tool-loop", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_forced_call_then_its_result_with_content_none(
    server: RunningServer, client: openai.OpenAI, choice: str
) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = create(client, server, messages, tool_choice=choice_of(choice), max_tokens=MAX_TOKENS)
    assert first.choices[0].finish_reason == "tool_calls"
    message = first.choices[0].message
    assert message.content is None  # what the client sends back
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)
    messages.append(message)
    result = {"temperature": 31, "unit": "celsius", "sky": "clear"}
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    second = create(client, server, messages, tool_choice="none", max_tokens=16)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # the call and its result were rendered into the second prompt
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_auto_is_served_and_a_result_turn_follows(
    server: RunningServer, client: openai.OpenAI
) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = create(client, server, messages, max_tokens=32)  # tool_choice auto: the parser
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Madrid"}'}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "31 degrees, clear"},
        {"role": "tool", "tool_call_id": "call_1", "content": "humidity 20%"},
    ]
    second = create(client, server, messages, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def create(client: openai.OpenAI, server: RunningServer, messages: list[Any], **fields: Any) -> Any:
    return client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER], temperature=0, **fields
    )
