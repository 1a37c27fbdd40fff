"""POST /v1/responses (OpenAI's Responses API, stateless) read as the chat request it
amounts to: `instructions` a system turn, `input` text or items (messages, function calls
and their outputs) the messages, Responses-style tools the chat's, and the options that
are Responses' own translated (service.api.responses_options). Every other field goes to
the chat's parser as it is, so the sampling fields the two APIs share (and vLLM's) are
honoured alike, and the chat's parser then checks all.

Nothing is stored: `previous_response_id` (a conversation kept by the server) is a 400."""

from __future__ import annotations

from typing import Any

from service.api.errors import bad_request
from service.api.responses_options import OWN_FIELDS, chat_options_of

# Chat Completions fields with no place in a Responses body: a 400 naming each, as a field
# the chat's parser would honour but the Responses answer could not show (n choices,
# logprobs without output_text) or one that has a Responses name.
CHAT_ONLY = (
    "messages",
    "n",
    "best_of",
    "max_tokens",
    "max_completion_tokens",
    "response_format",
    "logprobs",
    "echo",
    "stream_options",
)
# The Responses field behind a chat field the chat's parser or the engine names in a 400
RESPONSES_FIELDS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "reasoning_effort": "reasoning",
    "response_format": "text",
}


def chat_body_of(body: Any) -> dict[str, Any]:
    """The chat completion body that asks for what this Responses body asks."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in CHAT_ONLY:
        if name in body:
            raise bad_request(f"'{name}' is a Chat Completions field, not a Responses one", name)
    chat = {name: value for name, value in body.items() if name not in OWN_FIELDS}
    chat["messages"] = _instructions(body.get("instructions")) + messages_of(body.get("input"))
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return {**chat, **chat_options_of(body)}


def _instructions(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise bad_request("'instructions' must be a string", "instructions")
    return [{"role": "system", "content": value}]


def messages_of(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages; consecutive function calls are one assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"input[{index}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "function_call":
            _add_call(messages, item)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else str(output),
                }
            )
        elif kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind != "reasoning":  # a reasoning item is the model's own: not shown again
            raise bad_request(f"input[{index}]: items of type {kind!r} are not supported", "input")
    return messages


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    call = {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: Any) -> Any:
    """Input and output text parts as chat's text parts (other parts: the chat's 400)."""
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": part.get("text")}
        if isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
        else part
        for part in content
    ]


def _tools(value: Any) -> Any:
    """Responses' flat function tools as chat's nested ones."""
    if not isinstance(value, list):
        return value  # the chat's parser names the problem
    return [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        if isinstance(tool, dict) and tool.get("type") == "function"
        else tool
        for tool in value
    ]


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value
