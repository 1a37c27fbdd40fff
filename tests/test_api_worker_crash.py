"""The worker process killed with SIGKILL mid-stream: streams end cleanly, the server recovers."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import trio

from tests.server_fixtures import (
    RunningServer,
    StreamResult,
    stream_completion,
    wait_for_health,
)

pytestmark = pytest.mark.real_model


async def test_sigkill_of_the_worker_mid_stream(watched_server: RunningServer) -> None:
    old_pid = watched_server.admin_state()["worker_pid"]
    assert old_pid == watched_server.worker_pids()[-1]
    results: list[StreamResult] = []
    started = [trio.Event() for _ in range(4)]
    async with httpx.AsyncClient(base_url=watched_server.url, timeout=120) as client:

        async def one(i: int) -> None:
            body = {"prompt": f"Stream {i}", "max_tokens": 1000, "ignore_eos": True}
            results.append(await stream_completion(client, body, started[i]))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
            for event in started:
                await event.wait()
            os.kill(old_pid, signal.SIGKILL)
    for result in results:
        assert result.done, "the stream must end with [DONE]"
        assert result.error is not None and result.error["code"] == "worker_died"
        assert set(result.error) == {"message", "type", "param", "code"}
    down = await trio.to_thread.run_sync(wait_for_health, watched_server, 503, 10)
    up = await trio.to_thread.run_sync(wait_for_health, watched_server, 200, 300)
    print(f"/health 503 seen after {down:.2f} s, 200 again {up:.2f} s later")
    state = watched_server.admin_state()
    assert state["worker_pid"] != old_pid and watched_server.process.poll() is None
    assert state["last_worker_failure"]["reason"] == "worker_died"
    health = httpx.get(f"{watched_server.url}/health", timeout=10).json()
    assert health["last_worker_failure"]["reason"] == "worker_died"
    response = httpx.post(
        f"{watched_server.url}/v1/completions",
        timeout=60,
        json={"prompt": "Hello again", "max_tokens": 4, "ignore_eos": True},
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert watched_server.wait_idle()["kv_blocks_used"] == 0
