"""A stream's unread events are bounded in bytes (--max-stream-buffer-bytes), on the
simulated worker: a reader that never reads ends its request (every sequence of it) once
its unread events would pass the bound, keeping the tokens sent so far and freeing its
blocks; a reader that keeps up gets all of them; the API reports the end as an error."""

from __future__ import annotations

import trio

from service.api.openai_answer import failure_of
from service.engine.request import EVENT_BYTES, FinishEvent, TokenEvent, UnreadBytes, event_bytes
from tests.sim_worker import (
    SimTokenizer,
    collect,
    expected_tokens,
    greedy,
    running_engine,
    sim_config,
)

TOK = SimTokenizer()
LIMIT = 40 * EVENT_BYTES  # some 40 small token events


async def test_a_reader_that_never_reads_ends_its_request_at_the_bound(autojump_clock):
    prompt = TOK.encode("never read")
    async with running_engine(sim_config(max_stream_buffer_bytes=LIMIT)) as engine:
        channel = await engine.submit(prompt, greedy(500), request_id="slow", n=2)
        while engine.state()["running"] or engine.state()["waiting"]:
            await trio.sleep(0.1)  # nobody reads meanwhile
        assert engine.state()["kv_blocks_used"] == 0  # its blocks are free, not held for it
        events = [event async for event in channel]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    finishes = [e for e in events if isinstance(e, FinishEvent)]
    assert sorted(f.index for f in finishes) == [0, 1]
    assert {(f.reason, f.detail) for f in finishes} == {("error", "slow_reader")}
    assert sum(map(event_bytes, tokens)) <= LIMIT < sum(map(event_bytes, tokens)) + EVENT_BYTES
    leader = [t for e in tokens if e.index == 0 for t in e.token_ids]
    assert leader == expected_tokens(prompt, len(leader))  # what was sent stays right


async def test_a_reader_that_keeps_up_gets_every_token(autojump_clock):
    prompt = TOK.encode("keep up")
    async with running_engine(sim_config(max_stream_buffer_bytes=LIMIT)) as engine:
        events = await collect(await engine.submit(prompt, greedy(500), request_id="keeps-up"))
    assert events.token_ids == expected_tokens(prompt, 500)
    assert (events.finish.reason, events.finish.detail) == ("length", "max_tokens")


def test_the_first_event_into_an_empty_stream_always_fits() -> None:
    unread = UnreadBytes(limit=100)
    assert unread.take(1000, queued=0)  # one large event (a prompt's logprobs)
    assert not unread.take(10, queued=1)  # behind it, nothing more
    assert unread.take(10, queued=0) and unread.total == 10  # read: it counts no more
    assert unread.take(500, queued=1, always=True)  # a finish always goes in


def test_the_api_reports_a_slow_reader_as_an_error_in_the_stream() -> None:
    error = failure_of(FinishEvent("error", "slow_reader", 3, 40, "the client left ...", 0, 0))
    assert error is not None and error.status == 400 and error.code == "slow_reader"
