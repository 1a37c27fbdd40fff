"""Deadlines over HTTP on the real model: a request that cannot start in time gets an HTTP
error a client can retry on (429 `overloaded` at arrival, or 429 `deadline_exceeded` once its
deadline has passed in the queue), both with Retry-After, never a silent late answer; the
streams already running are unharmed; a stream with a deadline that starts in time is the
same stream."""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import trio

from tests.server_fixtures import RunningServer, stream_completion

pytestmark = pytest.mark.real_model

BUSY = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
LONG_PROMPT = "The history of the world, told briefly. " * 150  # ~1,200 tokens


def assert_retryable_refusal(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] in ("overloaded", "deadline_exceeded")
    assert error["type"] == "rate_limit_error" and "deadline" in error["message"]
    assert int(response.headers["Retry-After"]) >= 1


async def test_a_request_that_cannot_start_by_its_deadline_is_refused_and_streams_go_on(
    cadence_server: RunningServer,
) -> None:
    refusals: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=cadence_server.url, timeout=120) as client:
        flowing = trio.Event()
        async with trio.open_nursery() as nursery:
            busy: dict = {}

            async def run_busy() -> None:
                busy["result"] = await stream_completion(client, BUSY, flowing)

            nursery.start_soon(run_busy)
            await flowing.wait()
            # a long prompt queued ahead, then requests that may wait only 1 ms to start
            long = {"prompt": LONG_PROMPT, "max_tokens": 2}
            nursery.start_soon(partial(client.post, "/v1/completions", json=long))
            await trio.sleep(0.05)
            for stream in (False, True):
                body = {"prompt": "Hello", "max_tokens": 4, "deadline_ms": 1, "stream": stream}
                refusals.append(await client.post("/v1/completions", json=body))
            chat = {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "deadline_ms": 1,
            }
            refusals.append(await client.post("/v1/chat/completions", json=chat))
    print("refusals:", [(r.status_code, r.json()["error"]["message"]) for r in refusals])
    for response in refusals:
        assert_retryable_refusal(response)
    result = busy["result"]
    assert result.error is None and result.done and result.finish_reason == "length"
    assert len(result.text) > 0
    metrics = httpx.get(f"{cadence_server.url}/metrics", timeout=30).text
    shed = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("cadence:request_refused_total{")
    )
    assert shed >= len(refusals)


async def test_a_stream_with_a_deadline_it_meets_is_the_same_stream(
    cadence_server: RunningServer,
) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    async with httpx.AsyncClient(base_url=cadence_server.url, timeout=120) as client:
        plain = await stream_completion(client, body)
        timed = await stream_completion(client, {**body, "deadline_ms": 60_000})
        chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6}
        chat_body = {**chat, "temperature": 0, "stream": True, "deadline_ms": 60_000}
        async with client.stream("POST", "/v1/chat/completions", json=chat_body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert timed.text == plain.text and len(timed.chunks) == len(plain.chunks)
    assert timed.finish_reason == plain.finish_reason == "length" and timed.done
    assert '"role":"assistant"' in lines[0] and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("deadline", [0, -5, "10", True, 1e12, [1]])
def test_a_deadline_that_is_not_a_positive_number_of_ms_is_a_400(
    cadence_server: RunningServer, deadline: object
) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "deadline_ms": deadline}
    response = httpx.post(f"{cadence_server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "deadline_ms"
