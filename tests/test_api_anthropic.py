"""Anthropic's Messages API with Anthropic's official SDK against the shared real server: a
message whole and streamed (every event in order, the streamed text the whole one's), stop
sequences and max_tokens as Anthropic's stop reasons, count_tokens equal to the prompt the
engine ran, and bad requests as Anthropic's errors; without a server, a body read as the
chat it amounts to and the stream's blocks opened and closed in turn. Tools and thinking:
tests/test_api_tools.py (its server reads calls and reasoning); keys: tests/test_api_keys.py."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from service.api.anthropic_input import messages_request
from service.api.anthropic_output import MessageEvents
from service.api.errors import APIError
from service.api.openai_responses import ResponseHeader
from service.engine.request import FinishEvent
from tests.server_fixtures import RunningServer

QUESTION = [{"role": "user", "content": "Write a short poem about the sea."}]
SHORT = [{"role": "user", "content": "Count from one to twenty, in words."}]  # it answers briefly
MAX_TOKENS = 12
BLOCK_EVENTS = ("content_block_start", "content_block_delta", "content_block_stop")
RAW_EVENTS = ("message_start", *BLOCK_EVENTS, "message_delta", "message_stop")


@pytest.fixture(scope="module")
def client(cadence_server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=cadence_server.url, api_key="unused", max_retries=0, timeout=120
    )


def ask(model: str, **fields: Any) -> dict[str, Any]:
    # the SDK no longer names temperature: the HTTP API still takes it
    fields = {"max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0}, **fields}
    return {"model": model, "system": [{"type": "text", "text": "Answer briefly."}], **fields}


@pytest.mark.real_model
def test_a_message_whole_then_streamed_stopped_by_a_stop_sequence(
    client: anthropic.Anthropic, cadence_server: RunningServer
) -> None:
    fields = ask(cadence_server.model, messages=QUESTION)
    whole = client.messages.create(**fields)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.id.startswith("msg_") and whole.model == cadence_server.model
    (block,) = whole.content
    assert block.type == "text" and block.text
    # a poem: max_tokens ends it, every one of them generated
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == MAX_TOKENS
    counted = client.messages.count_tokens(
        model=fields["model"], system=fields["system"], messages=QUESTION
    )
    assert counted.input_tokens == whole.usage.input_tokens > 0

    stop = block.text.split()[2]  # a word the answer writes: it ends the answer there
    stopped = client.messages.create(**fields, stop_sequences=["never written", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == block.text[: block.text.index(stop)]

    with client.messages.stream(**fields, stop_sequences=["never written", stop]) as stream:
        events = [event for event in stream if event.type in RAW_EVENTS]
        final = stream.get_final_message()
    assert stream.response.headers["content-type"].startswith("text/event-stream")
    kinds = [event.type for event in events]
    deltas = ["content_block_delta"] * (len(kinds) - 5)
    block = ["content_block_start", *deltas, "content_block_stop"]
    assert kinds == ["message_start", *block, "message_delta", "message_stop"]
    events = events[1:-2]
    assert all(event.index == 0 for event in events)
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    assert text == final.content[0].text == stopped.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.usage.output_tokens == stopped.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


@pytest.mark.real_model
def test_the_raw_stream_is_anthropics_event_sequence(cadence_server: RunningServer) -> None:
    body = ask(cadence_server.model, messages=SHORT, max_tokens=16, stream=True)
    body.update(body.pop("extra_body"))
    with httpx.stream("POST", f"{cadence_server.url}/v1/messages", json=body, timeout=60) as reply:
        lines = list(reply.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [event["type"] for event in data] == names  # each event's name is its type
    names = [name for name in names if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert set(names[1:-2]) <= set(BLOCK_EVENTS)
    (delta,) = [event for event in data if event["type"] == "message_delta"]
    # the model ends its short answer itself
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert 0 < delta["usage"]["output_tokens"] < 16


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("change", "status", "kind", "names"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [{"role": "system", "content": "hi"}]}, 400, "invalid_request_error", "role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "'image'",
        ),
        ({"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
        ({"service_tier": "priority"}, 400, "invalid_request_error", "service_tier"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "s"}]},
            400,
            "invalid_request_error",
            "web_search",
        ),
        ({"model": "claude-opus-4-1"}, 404, "not_found_error", "claude-opus-4-1"),
    ],
)
def test_bad_requests_are_anthropic_errors(
    cadence_server: RunningServer, change: dict, status: int, kind: str, names: str
) -> None:
    body = {"model": cadence_server.model, "max_tokens": 4, "messages": QUESTION, **change}
    body = {name: value for name, value in body.items() if value is not None}
    reply = httpx.post(f"{cadence_server.url}/v1/messages", json=body, timeout=30)
    assert reply.status_code == status
    error = reply.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind
    assert names in error["error"]["message"]


@pytest.mark.real_model
def test_the_sdk_raises_the_error_its_status_names(
    client: anthropic.Anthropic, cadence_server: RunningServer
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=cadence_server.model, max_tokens=4, messages=[])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-haiku-4-5", messages=QUESTION)
    # shared code's errors too: the JSON-only rule, before any route runs
    reply = httpx.post(
        f"{cadence_server.url}/v1/messages", content=b"{}", timeout=30,
        headers={"Content-Type": "text/plain"},
    )  # fmt: skip
    assert reply.status_code == 415 and reply.json()["type"] == "error"


# ---- without a server ---------------------------------------------------------------------


def test_a_conversation_of_blocks_is_the_chat_it_amounts_to() -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": "Add 1 and 2."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "easy", "signature": ""},
                    {"type": "text", "text": "Calling."},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "3"},
                    {"type": "text", "text": "And "},
                    {"type": "text", "text": "then?"},
                ],
            },
        ],
        "tools": [{"name": "add", "description": "Add", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "metadata": {"user_id": "alice"},
        "top_k": 5,
    }
    chat = messages_request(body).chat
    call = {"id": "t1", "type": "function"}
    call["function"] = {"name": "add", "arguments": '{"a":1,"b":2}'}
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "Calling.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t1", "content": "3"},
        {"role": "user", "content": "And then?"},
    ]
    function = {"name": "add", "parameters": {"type": "object"}, "description": "Add"}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["parallel_tool_calls"] is False
    assert (chat["stop"], chat["user"], chat["top_k"]) == (["END"], "alice", 5)
    assert "metadata" not in chat and "stop_sequences" not in chat


def test_thinking_is_the_templates_switch_and_forced_tools_refuse_it() -> None:
    body = {"model": "m", "max_tokens": 2048, "messages": QUESTION}
    on = messages_request({**body, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert on.thinking and on.chat["chat_template_kwargs"] == {"enable_thinking": True}
    hidden = messages_request({**body, "thinking": {"type": "adaptive", "display": "omitted"}})
    assert hidden.thinking and hidden.chat["include_reasoning"] is False
    off = messages_request({**body, "thinking": {"type": "disabled"}}).chat
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in messages_request(body).chat
    for refused in (
        {"thinking": {"type": "enabled", "budget_tokens": 512}},
        {"thinking": {"type": "enabled", "budget_tokens": 4096}},  # not below max_tokens
        {"thinking": {"type": "adaptive"}, "tool_choice": {"type": "any"}, "tools": []},
    ):
        with pytest.raises(APIError) as error:
            messages_request({**body, **refused})
        assert error.value.status == 400 and error.value.param == "thinking"


def test_count_tokens_refuses_the_fields_of_a_generation() -> None:
    body = {"model": "m", "messages": QUESTION}
    assert messages_request(body, counting=True).chat["messages"] == QUESTION
    with pytest.raises(APIError, match="max_tokens"):
        messages_request({**body, "max_tokens": 4}, counting=True)


def test_the_stream_opens_and_closes_each_block_in_turn() -> None:
    events = MessageEvents(ResponseHeader("chat", "msg_1", "m"))
    deltas = [
        {"reasoning_content": "hmm"},
        {"reasoning_content": " ok", "content": "Hi"},
        {"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "f", "arguments": '{"a'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}]},
    ]
    sent = [event for delta in deltas for event in events.deltas(delta)]
    finish = FinishEvent("stop", "eos", 5, 7)
    sent += events.finished(finish, "tool_calls")
    shape = [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in sent]
    assert shape == [
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert sent[7]["content_block"] == {"type": "tool_use", "id": "c0", "name": "f", "input": {}}
    assert sent[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert sent[-2]["usage"] == {"output_tokens": 7}
