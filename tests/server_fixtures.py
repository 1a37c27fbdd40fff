"""Start a real cadence server (Hypercorn on loopback, the real default model) for API tests.

`cadence_server` (float32) is session-scoped and shared by every API test module, which
takes it by name (tests/conftest.py registers it once), so a test leaves the server as it
found it: no request left running, the policy swapped back. `one_at_a_time` (one sequence
at a time) and `watched_server` (whose worker tests kill: it is replaced) are shared likewise.
Tests that make a claim about outputs take `server_of_each_dtype` instead, which runs them
on that server and on a second one in bfloat16, the dtype users get by default. Tests that
break their server (shutting down, a worker that cannot restart) start their own with
`start_server`.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from service.config import default_cache_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "test-admin-token"
SMALL_KV_BYTES = 192 * 1024 * 1024
DTYPES = ("float32", "bfloat16")
STARTUP_SECONDS = 600.0  # the first run fetches and converts the default model
STEP_TIMEOUT = 3.0  # watched_server's


@dataclass(slots=True)
class RunningServer:
    url: str
    process: subprocess.Popen
    log_file: Path
    model: str

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def admin_state(self) -> dict:
        response = httpx.get(f"{self.url}/admin/state", headers=self.admin_headers(), timeout=10)
        response.raise_for_status()
        return response.json()

    def worker_pids(self) -> list[int]:
        """Pids of every worker this server started, oldest first (from its JSON log)."""
        return [event["pid"] for event in self.log_events("worker.started")]

    def log_events(self, name: str) -> list[dict]:
        lines = self.log_file.read_bytes().splitlines()
        events = [orjson.loads(line) for line in lines if line.startswith(b"{")]
        return [event for event in events if event.get("event") == name]

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll /admin/state until nothing runs, waits or holds KV blocks; return the state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.admin_state()
            if state["running"] == 0 and state["waiting"] == 0 and state["kv_blocks_used"] == 0:
                return state
            if time.monotonic() > deadline:
                return state
            time.sleep(0.1)

    def wait_healthy(self, timeout: float = STARTUP_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}: "
                    f"{self.log_file.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server at {self.url} not healthy after {timeout} s")


def wait_for_health(server: RunningServer, status: int, timeout: float) -> float:
    """Seconds until /health answers `status` (polling every 20 ms)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if httpx.get(f"{server.url}/health", timeout=10).status_code == status:
            return time.monotonic() - started
        time.sleep(0.02)
    raise TimeoutError(f"/health never answered {status} within {timeout} s")


def seconds_until(condition, timeout: float) -> float:
    """Seconds until `condition()` holds (polling every 20 ms); TimeoutError after `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - started


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def cache_dir() -> Path:
    return default_cache_dir() if os.environ.get("CADENCE_CACHE") else Path("/root/.cache/cadence")


def start_server(
    log_dir: Path,
    *extra_args: str,
    admin_token: str | None = ADMIN_TOKEN,
    wait: bool = True,
    dtype: str = "float32",
    keep_admin_env: bool = False,
) -> RunningServer:
    """Start `python -m service.cli serve --port 0 ...`; with `wait`, until /health is 200."""
    log_file = log_dir / "server.jsonl"
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--dtype",
        dtype,
        "--device",
        "cpu",
        "--kv-memory",
        str(SMALL_KV_BYTES),
        "--log-file",
        str(log_file),
        "--cache-dir",
        str(cache_dir()),
        *extra_args,
    ]
    if admin_token is not None:  # from a file, as operators should: a flag shows in `ps`
        token_file = log_dir / "admin-token"
        token_file.write_text(admin_token + "\n")
        command += ["--admin-token-file", str(token_file)]
    env = {k: v for k, v in os.environ.items() if keep_admin_env or k != "CADENCE_ADMIN_TOKEN"}
    stderr = open(log_dir / "server.stderr", "wb")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, env=env
    )
    url = read_listening_url(process, STARTUP_SECONDS)
    server = RunningServer(url, process, log_file, "SmolLM2-135M-Instruct")
    if not wait:
        return server
    try:
        server.wait_healthy()
        server.model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    except BaseException:
        stop_server(server)
        raise
    return server


def read_listening_url(process: subprocess.Popen, timeout: float) -> str:
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buffered = b""
    while time.monotonic() < deadline:
        if not selector.select(timeout=1.0):
            if process.poll() is not None:
                break
            continue
        chunk = os.read(process.stdout.fileno(), 4096)
        if not chunk:
            break
        buffered += chunk
        for line in buffered.decode(errors="replace").splitlines():
            if line.startswith("cadence listening on "):
                return line.removeprefix("cadence listening on ").strip()
    process.kill()
    raise RuntimeError(
        f"server did not print its URL; exit code {process.poll()}, stdout {buffered[-2000:]!r}"
    )


def stop_server(server: RunningServer, timeout: float = 30.0) -> int:
    """SIGTERM (a graceful shutdown), then SIGKILL if it hangs; returns the exit code."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


def served(
    tmp_path_factory: pytest.TempPathFactory, name: str, *args: str
) -> Iterator[RunningServer]:
    """A module's own server (`yield from` it in a fixture), stopped when the module ends."""
    server = start_server(tmp_path_factory.mktemp(name), *args)
    yield server
    stop_server(server)


# Registered once, in tests/conftest.py: one server of each dtype for the whole run. (A
# module's own alias of a session fixture is a fixture of its own: 18 aliases made 18
# servers, all alive to the end of the run.)
@pytest.fixture(scope="session")
def cadence_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(tmp_path_factory.mktemp("cadence-server"))
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def cadence_server_bf16(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(tmp_path_factory.mktemp("cadence-server-bf16"), dtype="bfloat16")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One sequence at a time and no aging: the waiting order is the `priority` policy's
    alone, and a second request waits while the first runs (a queued stream's heartbeats)."""
    server = start_server(
        tmp_path_factory.mktemp("one-at-a-time"),
        "--policy", "priority", "--policy-param", "aging_rate=0", "--max-num-seqs", "1",
    )  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def watched_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server whose worker the tests kill or stop (it is replaced each time), with a
    short step timeout, so that a stopped worker is noticed in seconds."""
    server = start_server(tmp_path_factory.mktemp("watched"), "--step-timeout", str(STEP_TIMEOUT))
    yield server
    stop_server(server)


@pytest.fixture(scope="session", params=DTYPES)
def server_of_each_dtype(request: pytest.FixtureRequest) -> RunningServer:
    name = {"float32": "cadence_server", "bfloat16": "cadence_server_bf16"}[request.param]
    return request.getfixturevalue(name)


@dataclass(slots=True)
class StreamResult:
    """What a client saw of one SSE response."""

    started: float
    chunks: list[dict] = field(default_factory=list)
    # wall-clock time of each data line: comparable with the `ts` of the server's log lines
    arrivals: list[float] = field(default_factory=list)
    error: dict | None = None
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(c["choices"][0].get("text", "") for c in self.chunks if c.get("choices"))

    @property
    def tokens(self) -> list[str]:
        """The text of each streamed token (request them with "logprobs": 0)."""
        return [
            token
            for c in self.chunks
            if c.get("choices") and c["choices"][0].get("logprobs")
            for token in c["choices"][0]["logprobs"]["tokens"]
        ]

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks if c.get("choices")]
        return next((r for r in reasons if r), None)

    @property
    def usage(self) -> dict | None:
        return next((c["usage"] for c in self.chunks if c.get("usage")), None)

    @property
    def streamed_tokens(self) -> int:
        """Tokens counted from the per-token logprobs (request them with "logprobs": 0)."""
        return sum(
            len(c["choices"][0]["logprobs"]["token_logprobs"])
            for c in self.chunks
            if c.get("choices") and c["choices"][0].get("logprobs")
        )


async def stream_completion(
    client: httpx.AsyncClient, body: dict, first_chunk: trio.Event | None = None
) -> StreamResult:
    """POST a streaming /v1/completions request and read it to the end."""
    result = StreamResult(started=time.time())
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            result.arrivals.append(time.time())
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                result.done = True
                break
            message = orjson.loads(payload)
            if "error" in message:
                result.error = message["error"]
            else:
                result.chunks.append(message)
            if first_chunk is not None:
                first_chunk.set()
    return result
