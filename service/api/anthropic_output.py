"""Answers shaped as Anthropic's Messages API: the whole message (its content blocks, stop
reason and usage) from the chat's message, and the stream's events from the chat stream's
deltas (service.api.chat_output reads both from one parse, so the stream's blocks
reassembled are the whole message's).

A stream is `message_start`, then each block opened (`content_block_start`), grown
(`content_block_delta`: text_delta, thinking_delta, input_json_delta) and closed
(`content_block_stop`) in turn, then `message_delta` (stop reason, output tokens) and
`message_stop`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from service.api.openai_responses import ResponseHeader
from service.engine.request import FinishEvent

# The chat's finish reasons (service.api.openai_responses.finish_reason_of) as Anthropic's
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def message_object(
    header: ResponseHeader, content: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """The message, its stop reason not yet known (a stream's first event holds it so)."""
    return {
        "id": header.request_id,
        "type": "message",
        "role": "assistant",
        "model": header.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def stop_fields(finish_reason: str, stop_string: str | None) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence` for a chat's finish reason and the stop string
    that ended it, if one did."""
    if stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_string}
    return {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None}


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}


def content_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's reasoning, content and calls as Anthropic's content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append(thinking_block(message["reasoning_content"]))
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        blocks.append(tool_use_block(call["id"], function["name"], function["arguments"]))
    return blocks


def thinking_block(thinking: str) -> dict[str, Any]:
    # no signature: nothing here checks one when the block comes back
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: str | None) -> dict[str, Any]:
    """A call's block; its `input` the arguments' object. None yet (a stream's first
    event), or not whole (a call max_tokens cut short): empty, as Anthropic's stream starts
    it; the stream's input_json_delta events still carry every character written."""
    return {"type": "tool_use", "id": call_id, "name": name, "input": _object_of(arguments)}


def _object_of(arguments: str | None) -> Any:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(slots=True)
class MessageEvents:
    """One stream's events: which block is open, and which block each call's is."""

    header: ResponseHeader
    open_kind: str | None = None  # "thinking" | "text" | "tool_use"
    blocks: int = 0  # blocks opened so far; the open one is the last
    call_blocks: dict[int, int] = field(default_factory=dict)  # call index -> block index

    def started(self, prompt_tokens: int) -> list[dict[str, Any]]:
        message = message_object(self.header, [], usage_of(prompt_tokens, 0))
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def deltas(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for a chat stream's delta (service.api.chat_output.MessageStream)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._grow(
                "thinking", "thinking_delta", "thinking", delta["reasoning_content"]
            )
        if delta.get("content"):
            events += self._grow("text", "text_delta", "text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finished(self, finish: FinishEvent, finish_reason: str) -> list[dict[str, Any]]:
        events = self._close()
        delta = stop_fields(finish_reason, finish.stop_string)
        usage = {"output_tokens": finish.completion_tokens}
        events.append({"type": "message_delta", "delta": delta, "usage": usage})
        return [*events, {"type": "message_stop"}]

    def _grow(self, kind: str, delta_type: str, name: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open_kind != kind:
            start = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            events += self._open(kind, start)
        events.append(self._delta(self.blocks - 1, {"type": delta_type, name: text}))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A call's first delta opens its block; each delta's arguments grow it."""
        events = []
        if "id" in call:
            start = tool_use_block(call["id"], call["function"]["name"], None)
            events += self._open("tool_use", start)
            self.call_blocks[call["index"]] = self.blocks - 1
        arguments = call["function"].get("arguments")
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            events.append(self._delta(self.call_blocks[call["index"]], delta))
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        events.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
        self.open_kind = kind
        self.blocks += 1
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    @staticmethod
    def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": index, "delta": delta}
