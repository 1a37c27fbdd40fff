"""Server-sent events: framing, and reading an engine channel in token groups with heartbeats."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
import trio

from service.engine.request import Event, FinishEvent

DONE = b"data: [DONE]\n\n"
# Sending something is how a dead client gets noticed while a request waits for its first
# token (hypercorn's trio worker only learns of a closed connection when a write to it
# fails; see tests/test_api_disconnect.py). A bare blank line, not an SSE comment: SSE
# parsers ignore it, and so do clients that strip each network read before parsing (vLLM's
# `bench serve` does; a ": comment" split off that way glues itself to the next event).
HEARTBEAT = b"\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse_data(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def event_groups(
    channel: trio.MemoryReceiveChannel,
    heartbeat_seconds: float,
    first: Sequence[Event] = (),
    sequences: int = 1,
) -> AsyncIterator[list[Event]]:
    """Yield the events that are ready, as one group; an empty group means "send a heartbeat".

    Grouping lets a slow client catch up in one write instead of one write per token.
    `first`: events already taken from the channel, which open the first group.
    A group ends at a FinishEvent; the whole ends after the FinishEvents of all `sequences`
    (a request's n) or when the engine closes the channel.
    """
    group: list[Event] = list(first)
    unfinished = sequences
    while True:
        if not group:
            with trio.move_on_after(heartbeat_seconds):
                try:
                    group.append(await channel.receive())
                except trio.EndOfChannel:
                    return
        # Never yield inside the timeout scope: the consumer's writes would run under it.
        while group and not isinstance(group[-1], FinishEvent):
            try:
                group.append(channel.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        yield group
        if group and isinstance(group[-1], FinishEvent):
            unfinished -= 1
            if unfinished == 0:
                return
        group = []
