"""A chat answer as the Responses API returns it: output items (reasoning, a message of
output_text, function calls), the response object, and the stream's typed events
(response.created ... response.completed) built from the chat deltas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from service.api.openai_responses import ResponseHeader
from service.api.responses_options import text_format

ECHOED = (
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "max_output_tokens",
    "metadata",
)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id("rs"),
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
    """`logprobs`: the chat's entries of its tokens (the same shape), if asked for."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": item_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_of(message: dict[str, Any], logprobs: list | None) -> list[dict[str, Any]]:
    """A chat message's output items, in the order the model wrote them."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"], "completed"))
    if message.get("content"):
        items.append(message_item(message["content"], "completed", logprobs))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(call_item(call["id"], function["name"], function["arguments"], "completed"))
    return items


def response_object(
    header: ResponseHeader,
    request: dict[str, Any],
    output: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The response: `finish_reason` None while in progress."""
    status = {None: "in_progress", "length": "incomplete"}.get(finish_reason, "completed")
    body: dict[str, Any] = {
        "id": header.request_id,
        "object": "response",
        "created_at": header.created,
        "model": header.model,
        "status": status,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "usage": None if usage is None else responses_usage(usage),
        "text": {"format": text_format(request)},
    }
    body.update({name: request.get(name) for name in ECHOED})
    body["tools"] = body["tools"] or []
    body["tool_choice"] = body["tool_choice"] or "auto"
    body["parallel_tool_calls"] = body["parallel_tool_calls"] is not False
    return body


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


@dataclass(slots=True)
class OpenItem:
    """An output item being streamed: what kind, where it is, what it holds so far."""

    item: dict[str, Any]
    index: int
    text: str = ""
    logprobs: list = field(default_factory=list)  # a message's, when asked for


@dataclass(slots=True)
class ResponseEvents:
    """The typed events of one streamed response, numbered in order."""

    header: ResponseHeader
    request: dict[str, Any]
    sequence: int = 0
    items: dict[Any, OpenItem] = field(default_factory=dict)  # "reasoning", "message", call i
    pending: list = field(default_factory=list)  # logprobs not yet sent with output text

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def started(self) -> list[dict[str, Any]]:
        response = response_object(self.header, self.request, [], None, None)
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def deltas(self, delta: dict[str, Any], logprobs: list) -> list[dict[str, Any]]:
        """The events of one chat delta; `logprobs`: its tokens' entries, sent with the
        next output text (a reader may hold text back)."""
        events = []
        self.pending += logprobs
        if delta.get("reasoning_content"):
            events += self._text(
                "reasoning", delta["reasoning_content"], "response.reasoning_text.delta"
            )
        if delta.get("content"):
            events += self._text("message", delta["content"], "response.output_text.delta")
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def _open(self, key: Any, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items[key] = OpenItem(item, len(self.items))
        events = [
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        ]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def _text(self, key: str, text: str, kind: str) -> list[dict[str, Any]]:
        events = []
        if key not in self.items:
            opened = (
                reasoning_item("", "in_progress")
                if key == "reasoning"
                else message_item("", "in_progress")
            )
            events += self._open(key, opened)
        open_ = self.items[key]
        open_.text += text
        logprobs: list = []
        if key == "message":
            logprobs, self.pending = self.pending, []
            open_.logprobs += logprobs
        events.append(
            self.event(
                kind,
                item_id=open_.item["id"],
                output_index=open_.index,
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        key, events = ("call", call["index"]), []
        if key not in self.items:
            function = call["function"]
            events += self._open(key, call_item(call["id"], function["name"], "", "in_progress"))
        open_ = self.items[key]
        piece = call["function"].get("arguments", "")
        open_.text += piece
        if piece:
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=open_.item["id"],
                    output_index=open_.index,
                    delta=piece,
                )
            )
        return events

    def finished(self, finish_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events, output = [], []
        if self.pending and "message" in self.items:  # the last tokens' (EOS: no text)
            events += self._text("message", "", "response.output_text.delta")
        for open_ in self.items.values():
            done, item_events = self._close(open_)
            events += item_events
            output.append(done)
        response = response_object(self.header, self.request, output, finish_reason, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=response)]

    def _close(self, open_: OpenItem) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        item, where = open_.item, {"item_id": open_.item["id"], "output_index": open_.index}
        events = []
        if item["type"] == "function_call":
            done = call_item(item["call_id"], item["name"], open_.text, "completed")
            events.append(
                self.event("response.function_call_arguments.done", arguments=open_.text, **where)
            )
        elif item["type"] == "message":
            done = message_item(open_.text, "completed", open_.logprobs)
            events.append(
                self.event(
                    "response.output_text.done",
                    content_index=0,
                    text=open_.text,
                    logprobs=open_.logprobs,
                    **where,
                )
            )
            events.append(
                self.event(
                    "response.content_part.done", content_index=0, part=done["content"][0], **where
                )
            )
        else:
            done = reasoning_item(open_.text, "completed")
            events.append(
                self.event(
                    "response.reasoning_text.done", content_index=0, text=open_.text, **where
                )
            )
        done["id"] = item["id"]
        events.append(self.event("response.output_item.done", output_index=open_.index, item=done))
        return done, events
