"""A chat's tool and template options, from JSON to what the template and the grammar get
(no model): defaults as OpenAI's, vLLM's rules for `auto` and `none`, the forced calls'
schemas, and tools, kwargs and reasoning_effort reaching the Jinja template."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from service.api.chat_setup import check_tool_choice, forced_calls_format, template_args
from service.api.errors import APIError
from service.api.openai_chat import parse_chat_options, parse_message
from service.config import Config
from service.tokenizer import Tokenizer
from tests.server_fixtures import cache_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def options(**body: object):
    return parse_chat_options(body.get)


def test_tools_default_to_auto_and_none_without_them() -> None:
    assert options(tools=[WEATHER]).tool_choice == "auto"
    assert options().tool_choice == "none"


def test_auto_needs_a_parser_as_in_vllm() -> None:
    with pytest.raises(APIError) as refused:
        check_tool_choice(options(tools=[WEATHER]), Config())
    assert refused.value.status == 400 and refused.value.param == "tool_choice"
    check_tool_choice(options(tools=[WEATHER]), Config(tool_call_parser="hermes"))


def test_tool_choice_none_still_shows_the_tools_unless_excluded() -> None:
    chat = options(tools=[WEATHER], tool_choice="none")
    assert template_args(chat, Config())["tools"] == [WEATHER]
    assert template_args(chat, Config(exclude_tools_when_tool_choice_none=True))["tools"] is None


def test_reasoning_effort_and_kwargs_are_template_variables() -> None:
    chat = options(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
    assert template_args(chat, Config()) == {
        "enable_thinking": False,
        "reasoning_effort": "low",
        "tools": None,
        "template": None,
    }


def test_forced_schemas_accept_only_calls_of_declared_tools() -> None:
    required = json.loads(
        forced_calls_format(options(tools=[WEATHER, CLOCK], tool_choice="required")).schema
    )
    jsonschema.validate(
        [
            {"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "get_time", "parameters": {}},
        ],
        required,
    )
    for wrong in (
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "launch", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    single = options(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(forced_calls_format(single).schema)["maxItems"] == 1
    named = options(
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert json.loads(forced_calls_format(named).schema) == WEATHER["function"]["parameters"]
    assert forced_calls_format(options(tools=[WEATHER])) is None  # auto: read, not forced


def test_assistant_calls_reach_the_template_with_object_arguments() -> None:
    message = parse_message(
        0,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
    )
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert message["content"] is None


def test_tools_and_kwargs_reach_the_jinja_template() -> None:
    tokenizer = Tokenizer.from_dir(cache_dir() / "models" / "SmolLM2-135M-Instruct")
    template = Path(__file__).with_name("hermes_template.jinja").read_text()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        True,
        tools=[WEATHER],
        template=template,
        enable_thinking=True,
        reasoning_effort="high",
    )
    assert json.dumps(WEATHER) in text and "(effort: high) hi" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    ids = tokenizer.encode_chat(
        [{"role": "user", "content": "hi"}], tools=[WEATHER], template=template
    )
    assert ids == tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[WEATHER], template=template
        )
    )
