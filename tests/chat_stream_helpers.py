"""Reassembling a chat stream's deltas into the message they add up to, as a client does."""

from __future__ import annotations

import itertools
from typing import Any

from service.api.chat_output import MessageStream, OutputReader


def reassemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The message of these deltas: content and reasoning joined (None if none came), calls
    by index (each first delta names it, the later ones only add arguments)."""
    content, reasoning, calls = [], [], {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls") or ():
            function = call["function"]
            if call["index"] not in calls:
                assert call["type"] == "function" and call["id"], call
                calls[call["index"]] = {"name": function["name"], "arguments": ""}
            else:  # OpenAI's shape: a later delta carries only the index and arguments
                assert set(call) == {"index", "function"} and set(function) == {"arguments"}
            calls[call["index"]]["arguments"] += function["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return {
        "content": "".join(content) or None,
        "reasoning_content": "".join(reasoning) or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
    }


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """A whole message as reassemble() writes one (calls without their ids)."""
    return {
        "content": message.get("content") or None,
        "reasoning_content": message.get("reasoning_content"),
        "tool_calls": [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message.get("tool_calls") or ()
        ],
    }


def stream_deltas(reader: OutputReader, text: str, cuts: list[int]) -> list[dict]:
    """The deltas of `text` streamed in the pieces that `cuts` (any integers) mark."""
    stream = MessageStream(reader)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    deltas = [stream.delta(text[a:b]) for a, b in itertools.pairwise(bounds)]
    deltas.append(stream.delta("", final=True))
    return [d for d in deltas if d]
