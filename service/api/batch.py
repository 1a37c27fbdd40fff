"""A list `prompt` of /v1/completions is one engine request per prompt; this merges their
event channels into one, whose sequence indices run across the prompts (prompt i's
sequence j becomes i x per_prompt + j), so one response streams them all as vLLM does."""

from __future__ import annotations

import trio

from service.engine.request import Event


def merge_channels(
    channels: list[trio.MemoryReceiveChannel], per_prompt: int, nursery: trio.Nursery
) -> trio.MemoryReceiveChannel[Event]:
    """One channel of all `channels`' events (forwarded by tasks in `nursery`), which ends
    when they all have. Closing it stops the forwarding and closes them."""
    # No buffer of its own: a client that stops reading leaves the events in the engine's
    # channels, whose bound on what a client has not read then ends its requests.
    send, receive = trio.open_memory_channel[Event](0)
    with send:
        for i, channel in enumerate(channels):
            nursery.start_soon(_forward, channel, send.clone(), i * per_prompt)
    return receive


async def _forward(
    source: trio.MemoryReceiveChannel, sink: trio.MemorySendChannel, offset: int
) -> None:
    with source, sink:
        try:
            async for event in source:
                event.index += offset
                await sink.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the response is gone; its cleanup aborts the requests
