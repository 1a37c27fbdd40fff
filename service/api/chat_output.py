"""A chat answer's text read as OpenAI's message: its reasoning (`reasoning_content`, vLLM's
field), its content and its tool calls; whole, or as the stream's deltas.

Both go through one reader: the stream parses its growing text each time new text comes
and sends what the parse holds beyond what was sent; the whole answer is the last parse.
Deltas reassembled therefore equal the whole message (see service.tool_calls)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from service import reasoning
from service.tool_calls import CallText, Parsed, ToolCallParser


@dataclass(slots=True)
class OutputReader:
    """How a request's answer is read: a reasoning parser or none, a tool-call parser or
    none, and how many calls may be returned (`parallel_tool_calls` false: one)."""

    reasons: bool = False
    starts_inside: bool = False  # the prompt opened the reasoning
    may_open: bool = False  # the prompt neither opened nor closed it: the model may open it
    shows_reasoning: bool = True  # false: read apart, then left out (include_reasoning)
    tools: ToolCallParser | None = None
    max_calls: int | None = None
    dropped: tuple[str, ...] = ()  # special tokens' texts that are not the answer's (EOS)

    def read(self, text: str, final: bool) -> tuple[str | None, Parsed]:
        """(reasoning or None, content and calls)."""
        for piece in self.dropped:
            text = text.replace(piece, "")
        thought = None
        if self.reasons:
            reasoned = reasoning.parse(text, final, self.starts_inside)
            thought, text = reasoned.reasoning, reasoned.content
            if not self.shows_reasoning:
                thought = None
        if self.tools is None:
            return thought, Parsed(content=text)
        parsed = self.tools.parse(text, final)
        parsed.calls = parsed.calls[: self.max_calls]
        return thought, parsed

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer's message."""
        thought, parsed = self.read(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": visible(parsed.content)}
        if self.reasons and self.shows_reasoning:
            message["reasoning_content"] = thought
        if parsed.calls:
            message["tool_calls"] = [tool_call(call, new_call_id()) for call in parsed.calls]
        return message


def visible(content: str) -> str | None:
    """Content that is only blanks (around or between calls, after the reasoning) is none."""
    return content if content.strip() else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call: CallText, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass(slots=True)
class MessageStream:
    """One choice's stream: its text so far and how much of its parse was sent."""

    reader: OutputReader
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)  # per call sent

    def delta(self, piece: str, final: bool = False) -> dict[str, Any]:
        """The delta that `piece` (the text that came since) adds; {} if none yet."""
        self.text += piece
        thought, parsed = self.reader.read(self.text, final)
        delta: dict[str, Any] = {}
        if thought is not None and len(thought) > self.reasoning_sent:
            delta["reasoning_content"] = thought[self.reasoning_sent :]
            self.reasoning_sent = len(thought)
        if visible(parsed.content) and len(parsed.content) > self.content_sent:
            delta["content"] = parsed.content[self.content_sent :]
            self.content_sent = len(parsed.content)
        calls = [d for i, call in enumerate(parsed.calls) if (d := self._call_delta(i, call))]
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)

    def _call_delta(self, index: int, call: CallText) -> dict[str, Any] | None:
        """OpenAI's shape: a call's first delta has its id, type, name and arguments so far;
        the next ones only its index and more arguments."""
        if index == len(self.arguments_sent):
            self.arguments_sent.append(len(call.arguments))
            return {"index": index, **tool_call(call, new_call_id())}
        sent = self.arguments_sent[index]
        if len(call.arguments) == sent:
            return None
        self.arguments_sent[index] = len(call.arguments)
        return {"index": index, "function": {"arguments": call.arguments[sent:]}}
