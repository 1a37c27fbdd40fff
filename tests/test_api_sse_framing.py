"""Server-sent events without a server: the bytes of each frame, and how events are grouped.

The HTTP tests (tests/test_api_streaming.py, tests/test_api_sse_heartbeat.py) need a real
model; these pin the same contract on `service.api.sse` alone, under trio's MockClock: one
`data:` line per event ending in a blank line, ready events sent as one group, an empty
group (a heartbeat) after `heartbeat_seconds` of silence, and the stream ending after the
FinishEvent or when the engine closes the channel.
"""

from __future__ import annotations

import orjson
import trio

from service.api.sse import DONE, HEARTBEAT, SSE_HEADERS, event_groups, sse_data
from service.engine.request import Event, FinishEvent, TokenEvent


def token(text: str) -> TokenEvent:
    return TokenEvent(text=text, token_ids=[ord(text[0]) if text else 0], logprobs=None)


FINISH = FinishEvent(reason="stop", detail="eos", prompt_tokens=3, completion_tokens=2)


def parse_frames(stream: bytes) -> list[object]:
    """What an SSE client sees: the data of each event, blank lines ignored."""
    out = []
    for frame in stream.split(b"\n\n"):
        lines = [line for line in frame.split(b"\n") if line]
        for line in lines:
            assert line.startswith(b"data: "), line
            payload = line[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


# ---- framing --------------------------------------------------------------------------------


def test_a_frame_is_one_data_line_of_compact_json_and_a_blank_line():
    frame = sse_data({"id": "x", "choices": [{"text": "héllo\nworld"}]})
    assert frame == b'data: {"id":"x","choices":[{"text":"h\xc3\xa9llo\\nworld"}]}\n\n'
    assert frame.count(b"\n") == 2  # a newline in the text is escaped, never raw


def test_frames_done_and_heartbeats_parse_back_in_order():
    stream = sse_data({"n": 1}) + HEARTBEAT + sse_data({"n": 2}) + HEARTBEAT + DONE
    assert parse_frames(stream) == [{"n": 1}, {"n": 2}, "[DONE]"]


def test_the_terminator_and_the_heartbeat_are_the_documented_bytes():
    assert DONE == b"data: [DONE]\n\n"
    assert HEARTBEAT == b"\n"  # a bare blank line: no event, nothing glued to the next one
    assert SSE_HEADERS["Content-Type"] == "text/event-stream; charset=utf-8"
    assert SSE_HEADERS["Cache-Control"] == "no-cache"
    assert SSE_HEADERS["X-Accel-Buffering"] == "no"


# ---- grouping -------------------------------------------------------------------------------


async def collect_groups(
    receive: trio.MemoryReceiveChannel, heartbeat_seconds: float = 1.0, limit: int = 50
) -> list[tuple[float, list[Event]]]:
    """Every group with the time it came; fails (rather than hangs) past `limit` groups."""
    groups = []
    async for group in event_groups(receive, heartbeat_seconds):
        groups.append((trio.current_time(), group))
        assert len(groups) <= limit, f"runaway stream: {groups[:3]}..."
    return groups


async def test_events_already_waiting_are_sent_as_one_group_ending_at_the_finish(
    autojump_clock,
):
    send, receive = trio.open_memory_channel(10)
    events = [token("a"), token("b"), token("c"), FINISH]
    for event in events:
        send.send_nowait(event)
    send.send_nowait(token("after the finish"))
    groups = await collect_groups(receive)
    assert [g for _, g in groups] == [events]
    assert receive.receive_nowait() == token("after the finish")  # not consumed


async def test_a_group_is_what_is_ready_now_and_later_events_form_the_next(autojump_clock):
    send, receive = trio.open_memory_channel(10)

    async def engine():
        send.send_nowait(token("a"))
        send.send_nowait(token("b"))
        await trio.sleep(0.3)
        send.send_nowait(token("c"))
        await trio.sleep(0.3)
        send.send_nowait(FINISH)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        groups = await collect_groups(receive, heartbeat_seconds=1.0)
    assert [g for _, g in groups] == [[token("a"), token("b")], [token("c")], [FINISH]]


async def test_silence_yields_an_empty_group_every_heartbeat_period(autojump_clock):
    send, receive = trio.open_memory_channel(10)

    async def engine():
        await trio.sleep(2.5)
        send.send_nowait(token("late"))
        send.send_nowait(FINISH)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        groups = await collect_groups(receive, heartbeat_seconds=1.0)
    assert [g for _, g in groups] == [[], [], [token("late"), FINISH]]
    assert [round(t - start, 6) for t, _ in groups] == [1.0, 2.0, 2.5]


async def test_no_heartbeat_while_events_keep_coming(autojump_clock):
    send, receive = trio.open_memory_channel(10)

    async def engine():
        for i in range(5):
            await trio.sleep(0.9)
            send.send_nowait(token(str(i)))
        send.send_nowait(FINISH)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        groups = await collect_groups(receive, heartbeat_seconds=1.0)
    assert all(g for _, g in groups)
    assert [e for _, g in groups for e in g] == [*(token(str(i)) for i in range(5)), FINISH]


async def test_a_closed_channel_ends_the_stream_without_a_heartbeat(autojump_clock):
    send, receive = trio.open_memory_channel(10)
    send.send_nowait(token("a"))
    await send.aclose()
    groups = await collect_groups(receive)
    assert [g for _, g in groups] == [[token("a")]]


async def test_a_channel_closed_with_nothing_sent_yields_nothing(autojump_clock):
    send, receive = trio.open_memory_channel(10)
    await send.aclose()
    assert await collect_groups(receive) == []


async def test_a_channel_closed_while_waiting_ends_the_stream(autojump_clock):
    send, receive = trio.open_memory_channel(10)

    async def engine():
        await trio.sleep(1.5)
        await send.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        groups = await collect_groups(receive, heartbeat_seconds=1.0)
    assert [g for _, g in groups] == [[]]  # one heartbeat at 1.0, then the end at 1.5


async def test_the_consumer_write_is_not_under_the_heartbeat_timeout(autojump_clock):
    """A slow write of one group must not be cancelled by the wait for the next."""
    send, receive = trio.open_memory_channel(10)
    send.send_nowait(token("a"))
    send.send_nowait(FINISH)
    written = []
    async for group in event_groups(receive, heartbeat_seconds=0.1):
        await trio.sleep(5)  # a slow client
        written.append(group)
    assert written == [[token("a"), FINISH]]
