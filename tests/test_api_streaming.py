"""SSE streaming on a real server: many concurrent streams, and tokens that arrive as made."""

from __future__ import annotations

import httpx
import pytest
import trio

from tests import server_fixtures
from tests.server_fixtures import RunningServer, stream_completion

pytestmark = pytest.mark.real_model


async def test_64_concurrent_streams_complete_with_exact_token_counts(
    cadence_server: RunningServer,
) -> None:
    results: dict[int, server_fixtures.StreamResult] = {}
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=cadence_server.url, timeout=180, limits=limits) as c:

        async def one(i: int) -> None:
            body = {
                "prompt": f"Count {i}",
                "max_tokens": 10,
                "temperature": 0.8,
                "seed": i,
                "ignore_eos": True,
                "logprobs": 0,
                "stream_options": {"include_usage": True},
            }
            results[i] = await stream_completion(c, body)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, i)
        elapsed = trio.current_time() - started
    print(f"64 streams x 10 tokens in {elapsed:.2f} s")
    assert len(results) == 64
    for result in results.values():
        assert result.done and result.error is None
        assert result.finish_reason == "length"
        assert result.usage["completion_tokens"] == 10
        assert result.streamed_tokens == 10
    assert cadence_server.wait_idle()["kv_blocks_used"] == 0


async def test_tokens_arrive_spread_over_the_generation(cadence_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=cadence_server.url, timeout=120) as client:
        result = await stream_completion(
            client,
            {
                "prompt": "Write a long story about a lighthouse keeper.",
                "max_tokens": 32,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
            },
        )
    assert result.done and result.streamed_tokens == 32
    text_times = [
        t for t, c in zip(result.arrivals, result.chunks, strict=False) if c["choices"][0]["text"]
    ]
    request_id = result.chunks[0]["id"]
    finished = next(
        e for e in cadence_server.log_events("request.finished") if e["request_id"] == request_id
    )
    early = [t for t in text_times if t < finished["ts"]]
    print(f"{len(text_times)} text events, {len(early)} of them before the last token was made")
    # Incremental delivery, by order, not by duration: text reached the client while the
    # server was still generating (a buffered response arrives only after its last token).
    assert len(text_times) >= 2 and early


async def test_sse_headers_and_no_cors_by_default(cadence_server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=cadence_server.url, timeout=60) as client:
        body = {"prompt": "hi", "max_tokens": 2, "stream": True, "priority": 3}
        headers = {"Origin": "http://elsewhere.example", "X-Tenant": "team-a"}
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            await resp.aread()
        preflight = await client.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://elsewhere.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-tenant",
            },
        )
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-accel-buffering"] == "no"
    assert resp.text.endswith("data: [DONE]\n\n")
    received = cadence_server.log_events("request.received")[-1]
    assert (received["tenant"], received["priority"]) == ("team-a", 3)
    # CORS is off unless --allowed-origins names the origin (tests/test_api_hardening.py)
    assert "access-control-allow-origin" not in resp.headers
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers


def test_browser_page_is_served_at_the_root(cadence_server: RunningServer) -> None:
    response = httpx.get(f"{cadence_server.url}/", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in response.text
