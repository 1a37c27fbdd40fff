"""A real server and its real worker, treated as a careless operator and a hostile client
would: the worker killed or stopped while idle or mid-stream, a worker that cannot start
again, a client that never reads while the server shuts down, secrets in `ps` and in the
worker's environment, a log file that must not grow without bound."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from tests.server_fixtures import (
    ADMIN_TOKEN,
    STEP_TIMEOUT,
    RunningServer,
    alive,
    cache_dir,
    seconds_until,
    start_server,
    stop_server,
    stream_completion,
    wait_for_health,
)

pytestmark = pytest.mark.real_model


def replaced_worker(server: RunningServer, old_pid: int) -> int:
    wait_for_health(server, 200, 300)
    new_pid = server.admin_state()["worker_pid"]
    assert new_pid != old_pid and not alive(old_pid)
    return new_pid


def test_the_admin_token_is_in_neither_ps_nor_the_worker_environment(
    watched_server: RunningServer,
) -> None:
    """start_server gives the token in a file, as operators should."""
    server_cmdline = Path(f"/proc/{watched_server.process.pid}/cmdline").read_bytes()
    worker_pid = watched_server.admin_state()["worker_pid"]  # the token from the file works
    worker_env = Path(f"/proc/{worker_pid}/environ").read_bytes()
    assert ADMIN_TOKEN.encode() not in server_cmdline
    assert b"--admin-token-file" in server_cmdline
    assert ADMIN_TOKEN.encode() not in worker_env


RESTARTS = "cadence:worker_restarts_total "


def restarts(server: RunningServer) -> float:
    """The restarts /metrics counts (the server is shared: other tests restart it too)."""
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    (line,) = [line for line in metrics.splitlines() if line.startswith(RESTARTS)]
    return float(line.split()[1])


def test_sigkill_of_an_idle_worker_is_noticed_at_once(watched_server: RunningServer) -> None:
    old_pid = watched_server.admin_state()["worker_pid"]
    before = restarts(watched_server)
    os.kill(old_pid, signal.SIGKILL)
    down = wait_for_health(watched_server, 503, 10)
    replaced_worker(watched_server, old_pid)
    print(f"/health went 503 {down:.2f} s after the SIGKILL, with no request sent")
    assert restarts(watched_server) == before + 1


def test_sigstop_of_an_idle_worker_is_noticed_and_the_worker_replaced(
    watched_server: RunningServer,
) -> None:
    old_pid = watched_server.admin_state()["worker_pid"]
    os.kill(old_pid, signal.SIGSTOP)
    down = wait_for_health(watched_server, 503, 30)
    replaced_worker(watched_server, old_pid)
    print(f"/health went 503 {down:.2f} s after the SIGSTOP (step timeout {STEP_TIMEOUT} s)")
    hung = watched_server.log_events("worker.hung")
    assert hung and hung[-1]["running"] == 0


async def test_sigstop_mid_stream_ends_the_stream_and_the_server_recovers(
    watched_server: RunningServer,
) -> None:
    old_pid = watched_server.admin_state()["worker_pid"]
    first = trio.Event()
    results: list = []
    async with (
        httpx.AsyncClient(base_url=watched_server.url, timeout=120) as client,
        trio.open_nursery() as nursery,
    ):

        async def one() -> None:
            body = {"prompt": "Count", "max_tokens": 2000, "ignore_eos": True}
            results.append(await stream_completion(client, body, first))

        nursery.start_soon(one)
        await first.wait()
        stopped_at = time.monotonic()
        os.kill(old_pid, signal.SIGSTOP)
        nursery.cancel_scope.deadline = trio.current_time() + 60  # a hang fails the test
    ended = time.monotonic() - stopped_at
    (result,) = results
    assert result.done and result.error is not None
    assert result.error["code"] == "worker_hung", result.error
    print(f"the stream ended {ended:.2f} s after the worker was stopped")
    await trio.to_thread.run_sync(replaced_worker, watched_server, old_pid)
    response = httpx.post(
        f"{watched_server.url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    assert response.status_code == 200


def test_a_worker_that_cannot_restart_fails_the_queue_and_the_server_exits_1(
    tmp_path: Path,
) -> None:
    model = tmp_path / "SmolLM2-135M-Instruct"
    model.mkdir()
    source = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    for item in source.iterdir():
        (model / item.name).symlink_to(item)
    server = start_server(
        tmp_path, "--model", str(model), "--max-num-seqs", "1", "--max-worker-restarts", "2"
    )
    try:
        (model / "model.safetensors").unlink()  # every later start fails
        first = trio.Event()

        async def two_streams() -> list:
            results: list = []
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=120) as client,
                trio.open_nursery() as nursery,
            ):

                async def one(prompt: str) -> None:
                    body = {"prompt": prompt, "max_tokens": 500, "ignore_eos": True}
                    results.append((prompt, await stream_completion(client, body, first)))

                nursery.start_soon(one, "running")
                await first.wait()
                nursery.start_soon(one, "waiting")
                await trio.sleep(0.5)  # admitted behind the running one
                os.kill(server.admin_state()["worker_pid"], signal.SIGKILL)
            return results

        results = dict(trio.run(two_streams))
        code = server.process.wait(60)
    finally:
        stop_server(server)
    assert results["running"].error["code"] == "worker_died"
    assert results["waiting"].error["code"] == "worker_unavailable", results["waiting"].error
    assert code == 1
    assert len(server.log_events("worker.restart_failed")) == 2


def test_a_client_that_never_reads_cannot_hold_the_server_at_shutdown(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--shutdown-timeout", "1")
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    client.connect((host, int(port)))
    body = orjson.dumps(
        {
            "prompt": "Tell a long story",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 20,  # ~3 KB per event: the socket buffers fill sooner
        }
    )
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    client.sendall(head.encode() + body)
    try:
        # the server's send buffer fills while the client reads nothing
        seconds_until(lambda: server.admin_state()["iteration"] > 100, 600)
        stopped = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(60)
        took = time.monotonic() - stopped
    finally:
        client.close()
        stop_server(server)
    print(f"exited {took:.1f} s after SIGTERM with a client that never read")
    assert code == 0
    assert server.log_events("server.connections_cut")[0]["count"] >= 1


ENV_TOKEN = "token-from-the-environment"


@pytest.fixture(scope="module")
def env_token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The admin token from the environment, and a log file rotated at 20 kB with 2 backups:
    one server for the two tests below (the rotation test, the last, stops it)."""
    os.environ["CADENCE_ADMIN_TOKEN"] = ENV_TOKEN
    try:
        server = start_server(
            tmp_path_factory.mktemp("env-token"),
            *("--log-max-bytes", "20000", "--log-backups", "2"),
            admin_token=None,
            keep_admin_env=True,
        )
    finally:
        del os.environ["CADENCE_ADMIN_TOKEN"]
    yield server
    stop_server(server)


def test_the_admin_token_from_the_environment_stays_out_of_the_worker(
    env_token_server: RunningServer,
) -> None:
    state = httpx.get(
        f"{env_token_server.url}/admin/state",
        headers={"Authorization": f"Bearer {ENV_TOKEN}"},
        timeout=10,
    )
    worker_env = Path(f"/proc/{state.json()['worker_pid']}/environ").read_bytes()
    assert state.status_code == 200
    assert b"CADENCE_ADMIN_TOKEN" not in worker_env


def test_the_log_file_rotates_and_keeps_whole_lines(env_token_server: RunningServer) -> None:
    server = env_token_server
    log_dir = server.log_file.parent
    try:
        for i in range(6):
            response = httpx.post(
                f"{server.url}/v1/completions",
                json={"prompt": f"Story {i}", "max_tokens": 30, "ignore_eos": True},
                timeout=60,
            )
            assert response.status_code == 200
    finally:
        stop_server(server)
    files = sorted(log_dir.glob("server.jsonl*"))
    assert [f.name for f in files] == ["server.jsonl", "server.jsonl.1", "server.jsonl.2"]
    for file in files:
        data = file.read_bytes()
        assert len(data) <= 20000 + 2000  # one line may cross the limit
        for line in data.splitlines():
            orjson.loads(line)  # whole JSON lines only
    shutil.rmtree(log_dir, ignore_errors=True)
