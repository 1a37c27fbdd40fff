"""A queued request's stream carries heartbeats that every kind of SSE client survives."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from tests.server_fixtures import RunningServer, stream_completion

pytestmark = pytest.mark.real_model
HEARTBEATS = 2  # before the queued request starts: two run into each other unparsed


def events_as_a_read_stripping_client_sees_them(reads: list[bytes]) -> list[str]:
    """Parse SSE the way vLLM's `bench serve` does: each network read is stripped first.

    A heartbeat that is an SSE comment would lose its blank line this way and glue itself
    to the next event, which the client then drops as a comment: the whole stream is lost.
    """
    buffer, messages = "", []
    for read in reads:
        read = read.strip()
        if not read:
            continue
        buffer += read.decode()
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            messages.append(message.strip())
        if buffer.startswith("data: "):
            content = buffer.removeprefix("data: ").strip()
            if content == "[DONE]" or _is_json(content):
                messages.append(buffer.strip())
                buffer = ""
    return [m.removeprefix("data: ") for m in messages if not m.startswith(":")]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


async def test_heartbeats_of_a_queued_request_do_not_break_clients(
    one_at_a_time: RunningServer,
) -> None:
    async with httpx.AsyncClient(base_url=one_at_a_time.url, timeout=120) as client:
        first_token = trio.Event()
        heartbeats = trio.Event()
        reads: list[bytes] = []

        async def queued_stream() -> None:
            body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for raw in response.aiter_raw():
                    reads.append(raw)
                    if b"".join(reads).startswith(HEARTBEATS * b"\n"):
                        heartbeats.set()

        # The only slot is busy until the second request, waiting, has had HEARTBEATS
        # heartbeats (one a second) before its first token; then the first request's
        # client goes away, which frees the slot.
        long = {"prompt": "Go on", "max_tokens": 2000, "ignore_eos": True}
        long_scope = trio.CancelScope()

        async def long_stream() -> None:
            with long_scope:
                await stream_completion(client, long, first_token)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            await first_token.wait()
            nursery.start_soon(queued_stream)
            with trio.fail_after(60):
                await heartbeats.wait()
            long_scope.cancel()
    raw = b"".join(reads)
    assert raw.startswith(b"\n"), raw[:80]  # heartbeats came before the first event
    # Replay the bytes as separate network reads split at every heartbeat.
    pieces = [p + b"\n" for p in raw.split(b"\n")]
    messages = events_as_a_read_stripping_client_sees_them(pieces)
    chunks = [json.loads(m) for m in messages if m != "[DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
    assert messages[-1] == "[DONE]"
    assert len([t for t in texts if t]) >= 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
