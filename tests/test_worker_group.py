"""A tensor-parallel worker group on the real default model: a real server at
--tensor-parallel-size 3 (SmolLM2-135M has 9 heads and 3 KV heads), its three ranks
listed by /admin/state, greedy completions as one worker gives them, and the faults an
operator meets: a follower killed or stopped mid-stream, rank 0 killed, a group idle past
its collective timeout, a size that does not divide the model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import trio

from tests.server_fixtures import (
    REPO_ROOT,
    RunningServer,
    StreamResult,
    seconds_until,
    start_server,
    stop_server,
    stream_completion,
    wait_for_health,
)

pytestmark = pytest.mark.real_model

WORLD = 3
STEP_TIMEOUT = 6.0  # the group's collectives time out after half (worker_config_for)
COLLECTIVE_TIMEOUT = STEP_TIMEOUT / 2
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three primary colours are",
    "Once upon a time, in a quiet village by the sea,",
]


@pytest.fixture(scope="module")
def group_server(tmp_path_factory: pytest.TempPathFactory):
    server = start_server(
        tmp_path_factory.mktemp("tp3"),
        "--tensor-parallel-size", str(WORLD), "--step-timeout", str(STEP_TIMEOUT),
    )  # fmt: skip
    yield server
    stop_server(server)


def ranks(server: RunningServer) -> list[dict]:
    return server.admin_state()["worker_ranks"]


def running(pid: int) -> bool:
    """A live process (a zombie, killed and not yet reaped by its new parent, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def complete(server: RunningServer, prompt: str, max_tokens: int = 24) -> str:
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def replaced_group(server: RunningServer, old: list[dict]) -> list[dict]:
    """The new group's ranks, once the server reports another group (it notices a rank
    killed while idle at its next read or ping, so /health may still be 200 a moment
    after the kill) and /health is 200 again: every one a new, live process, and none of
    the old group left."""
    old_pids = {r["pid"] for r in old}
    seconds_until(lambda: not {r["pid"] for r in ranks(server)} & old_pids, 300)
    wait_for_health(server, 200, 300)
    new = ranks(server)
    assert len(new) == WORLD
    assert not {r["pid"] for r in new} & {r["pid"] for r in old}
    assert all(running(r["pid"]) for r in new)
    seconds_until(lambda: not any(running(r["pid"]) for r in old), 5)
    return new


async def streams_while(server: RunningServer, count: int, act) -> tuple[list[StreamResult], float]:
    """`count` streams; once each has its first token, `act()`; the results and when
    `act` ran (time.time())."""
    results: list[StreamResult] = []
    started = [trio.Event() for _ in range(count)]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

        async def one(i: int) -> None:
            body = {"prompt": f"Stream {i}", "max_tokens": 2000, "ignore_eos": True}
            results.append(await stream_completion(client, body, started[i]))

        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(one, i)
            for event in started:
                await event.wait()
            acted_at = time.time()
            act()
            nursery.cancel_scope.deadline = trio.current_time() + 60  # a hang fails the test
    return results, acted_at


def ended_with(results: list[StreamResult], code: str, since: float, within: float) -> None:
    """Every stream ended, with error `code`, within `within` seconds of `since`."""
    for result in results:
        assert result.done and result.error is not None
        assert result.error["code"] == code, result.error
        assert result.arrivals[-1] - since < within
    print(f"streams ended {max(r.arrivals[-1] for r in results) - since:.2f} s after")


def served_by_a_new_group(server: RunningServer, old: list[dict]) -> dict:
    """The group replaced (replaced_group), a request served, no KV block left held; the
    failure the server recorded."""
    replaced_group(server, old)
    assert complete(server, PROMPTS[1], 4)
    assert server.wait_idle()["kv_blocks_used"] == 0
    return server.admin_state()["last_worker_failure"]


def test_admin_state_lists_three_ranks_with_a_third_of_the_kv_each(
    group_server: RunningServer, cadence_server: RunningServer
) -> None:
    """Same KV memory flag, same dtype: the three ranks' caches together take one
    worker's, each holding one of the three KV heads of the same blocks."""
    group, single = ranks(group_server), ranks(cadence_server)
    assert [r["rank"] for r in group] == [0, 1, 2]
    assert group[0]["pid"] == group_server.admin_state()["worker_pid"]
    assert all(parent_of(r["pid"]) == group[0]["pid"] for r in group[1:])
    assert len({r["kv_bytes"] for r in group}) == 1
    assert sum(r["kv_bytes"] for r in group) == single[0]["kv_bytes"]
    assert len(single) == 1 and single[0]["pid"] == cadence_server.admin_state()["worker_pid"]


def test_greedy_completions_equal_one_workers(
    group_server: RunningServer, cadence_server: RunningServer
) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch each: their steps shared
        split = list(pool.map(lambda prompt: complete(group_server, prompt), PROMPTS))
        whole = list(pool.map(lambda prompt: complete(cadence_server, prompt), PROMPTS))
    for prompt, mine, theirs in zip(PROMPTS, split, whole, strict=True):
        print(f"{prompt!r}: {mine!r}")
        assert mine == theirs


def test_a_group_idle_past_its_collective_timeout_still_serves(
    group_server: RunningServer,
) -> None:
    before = ranks(group_server)
    time.sleep(COLLECTIVE_TIMEOUT + 1.5)
    assert complete(group_server, PROMPTS[0], 4)
    assert ranks(group_server) == before


async def test_a_follower_killed_mid_stream_ends_the_streams_at_once_and_the_group_restarts(
    group_server: RunningServer,
) -> None:
    old = ranks(group_server)
    results, killed_at = await streams_while(
        group_server, 3, lambda: os.kill(old[2]["pid"], signal.SIGKILL)
    )
    ended_with(results, "worker_died", killed_at, 2.0)
    failure = await trio.to_thread.run_sync(served_by_a_new_group, group_server, old)
    assert failure["reason"] == "worker_died" and "rank 2" in failure["error"]


async def test_a_stopped_follower_times_out_and_the_group_restarts(
    group_server: RunningServer,
) -> None:
    old = ranks(group_server)
    results, stopped_at = await streams_while(
        group_server, 2, lambda: os.kill(old[1]["pid"], signal.SIGSTOP)
    )
    ended_with(results, "worker_hung", stopped_at, STEP_TIMEOUT)  # before the watchdog
    failure = await trio.to_thread.run_sync(served_by_a_new_group, group_server, old)
    assert failure["reason"] == "worker_hung"


def test_a_follower_stopped_while_idle_is_found_by_the_next_ping(
    group_server: RunningServer,
) -> None:
    """Rank 0 hands each idle ping on; a follower stopped between plans makes that hand-on
    time out after the collective timeout (gloo's send waits for a ready receiver), and
    rank 0 says so, before the service's own ping deadline."""
    old = ranks(group_server)
    os.kill(old[2]["pid"], signal.SIGSTOP)
    found = wait_for_health(group_server, 503, 30)
    print(f"the stopped follower was found {found:.2f} s after it stopped")
    assert found < STEP_TIMEOUT
    replaced_group(group_server, old)
    failure = group_server.admin_state()["last_worker_failure"]
    assert failure["reason"] == "worker_hung"
    assert "handing a message to the followers failed" in failure["error"], failure
    assert complete(group_server, PROMPTS[0], 4)


def test_rank_0_killed_leaves_no_follower_and_the_group_restarts(
    group_server: RunningServer,
) -> None:
    old = ranks(group_server)
    os.kill(old[0]["pid"], signal.SIGKILL)
    gone = seconds_until(lambda: not any(running(r["pid"]) for r in old[1:]), 2)
    print(f"the followers were gone {gone:.2f} s after rank 0")
    replaced_group(group_server, old)
    assert complete(group_server, PROMPTS[3], 4)


def test_a_size_that_does_not_divide_the_model_is_refused_at_start(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--tensor-parallel-size", "2", wait=False)
    try:
        code = server.process.wait(120)
    finally:
        stop_server(server)
    stderr = (tmp_path / "server.stderr").read_text()
    assert code == 1
    assert "tensor parallel size 2 does not divide the model's 9 attention heads" in stderr
    assert "sizes that fit this model: 1, 3" in stderr


def test_a_rank_started_elsewhere_joins_rank_0s_store_and_the_group_serves(
    tmp_path: Path, cadence_server: RunningServer
) -> None:
    """vLLM's headless mode on one host: rank 0 starts ranks 0 and 1 only; rank 2 is
    started by hand against the store's address, learns the group from it, serves, and
    exits when the server stops."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    server = start_server(
        tmp_path,
        "--tensor-parallel-size", str(WORLD), "--tensor-parallel-size-local", "2",
        "--tensor-parallel-address", address,
        wait=False,
    )  # fmt: skip
    with open(tmp_path / "rank2.stderr", "wb") as stderr:
        elsewhere = subprocess.Popen(
            [sys.executable, "-m", "gpu_worker.follower", "--store", address, "--rank", "2",
             "--local-rank", "0", "--local-size", "1"],
            cwd=REPO_ROOT, stderr=stderr,
        )  # fmt: skip
    try:
        server.wait_healthy()
        group = ranks(server)
        assert [r["pid"] for r in group][2] == elsewhere.pid
        assert parent_of(elsewhere.pid) != group[0]["pid"]
        assert parent_of(group[1]["pid"]) == group[0]["pid"]
        for prompt in PROMPTS[:2]:
            assert complete(server, prompt) == complete(cadence_server, prompt)
    finally:
        stop_server(server)
        try:
            code = elsewhere.wait(30)
        finally:
            elsewhere.kill()
    assert code == 0, (tmp_path / "rank2.stderr").read_text()[-2000:]
