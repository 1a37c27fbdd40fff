"""Clients hanging up mid-stream abort their requests (over real sockets, hypercorn issue 210)."""

from __future__ import annotations

import re
import time
from urllib.parse import urlsplit

import orjson
import pytest
import trio

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
MAX_TOKENS = 48


def raw_request(host: str, body: dict) -> bytes:
    payload = orjson.dumps(body)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: keep-alive\r\n\r\n"
    )
    return head.encode() + payload


async def read_until(stream: trio.SocketStream, buffer: bytearray, marker: bytes) -> bool:
    while marker not in buffer:
        if not await _more(stream, buffer):
            return False
    return True


async def test_8_of_16_clients_hang_up_and_their_requests_are_aborted(
    cadence_server: RunningServer,
) -> None:
    url = urlsplit(cadence_server.url)
    assert url.hostname is not None and url.port is not None
    finished_before = len(cadence_server.log_events("request.finished"))
    outcomes: dict[int, bytes] = {}
    hung_up_at: dict[str, float] = {}  # request id -> wall-clock time of the hang-up

    async def client(i: int, hang_up: bool) -> None:
        stream = await trio.open_tcp_stream(url.hostname, url.port)
        body = {
            "prompt": f"Tell me story number {i}.",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0.7,
            "seed": i,
            "stream": True,
        }
        await stream.send_all(raw_request(url.netloc, body))
        buffer = bytearray()
        # Hang up after two token chunks: the request is decoding by then.
        while buffer.count(b'"text_completion"') < 2:
            assert await _more(stream, buffer)
        if hang_up:
            hung_up_at[request_id_of(buffer)] = time.time()
            await stream.aclose()
            outcomes[i] = bytes(buffer)
            return
        await read_until(stream, buffer, b"data: [DONE]")
        outcomes[i] = bytes(buffer)
        await stream.aclose()

    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(client, i, i % 2 == 0)
    state = cadence_server.wait_idle(timeout=10)
    print("state after the hang-ups:", state)
    assert (state["running"], state["waiting"], state["kv_blocks_used"]) == (0, 0, 0)
    finished = cadence_server.log_events("request.finished")[finished_before:]
    aborted = [e for e in finished if e["finish_reason"] == "abort"]
    completed = [e for e in finished if e["finish_reason"] == "length"]
    print("aborted after", sorted(e["completion_tokens"] for e in aborted), "tokens")
    assert len(aborted) == 8 and len(completed) == 8
    assert all(e["completion_tokens"] < MAX_TOKENS for e in aborted)
    assert all(e["completion_tokens"] == MAX_TOKENS for e in completed)
    for i in range(1, 16, 2):
        assert outcomes[i].endswith(b"data: [DONE]\n\n") or b"data: [DONE]" in outcomes[i]
    # Measured in the engine's own iterations: the iteration running when the client hung
    # up is the first whose end is logged after it; the abort must come within one more.
    ends = [(e["ts"], e["iteration"]) for e in cadence_server.log_events("iteration")]
    late_by = []
    for event in aborted:
        at_hang_up = min(n for ts, n in ends if ts >= hung_up_at[event["request_id"]])
        late_by.append(event["iteration"] - at_hang_up)
    print("aborted this many iterations after the one running at the hang-up:", late_by)
    assert max(late_by) <= 1


def request_id_of(response: bytearray) -> str:
    match = re.search(rb"x-request-id: (\S+)\r\n", bytes(response), re.IGNORECASE)
    assert match is not None, response[:500]
    return match.group(1).decode()


async def _more(stream: trio.SocketStream, buffer: bytearray) -> bool:
    data = await stream.receive_some(65536)
    buffer += data
    return bool(data)


async def test_a_client_that_hangs_up_on_a_whole_response_has_its_request_aborted(
    cadence_server: RunningServer,
) -> None:
    """Not streamed: the server is only waiting for the whole answer when the client goes,
    and the hang-up must still abort the request and free its blocks, not run it to the
    end of its 2,000 tokens."""
    url = urlsplit(cadence_server.url)
    assert url.hostname is not None and url.port is not None
    finished_before = len(cadence_server.log_events("request.finished"))
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
    stream = await trio.open_tcp_stream(url.hostname, url.port)
    await stream.send_all(raw_request(url.netloc, body))
    with trio.fail_after(60):
        while cadence_server.admin_state()["kv_blocks_used"] == 0:
            await trio.sleep(0.05)  # admitted and decoding
    await trio.sleep(0.5)
    await stream.aclose()
    state = cadence_server.wait_idle(timeout=10)
    assert (state["running"], state["waiting"], state["kv_blocks_used"]) == (0, 0, 0)
    finished = cadence_server.log_events("request.finished")[finished_before:]
    assert [(e["finish_reason"], e["finish_detail"]) for e in finished] == [("abort", "aborted")]
    assert finished[0]["completion_tokens"] < 2000
