"""`cadence replicas`: two real replicas behind a real sglang-router, through the official
openai client; then one replica is killed and the router carries on with the other; then
Ctrl-C's SIGTERM stops everything, leaving no process behind."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.pd_launch import LISTENING
from tests.server_fixtures import REPO_ROOT, SMALL_KV_BYTES, STARTUP_SECONDS, cache_dir

pytestmark = pytest.mark.real_model
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
# The router checks health every 2 s and drops a worker after one failed check.
ROUTER_ARGS = ("--health-check-interval-secs=2", "--health-failure-threshold=1")
NOTICE_SECONDS = 15.0


@dataclass(slots=True)
class Replicas:
    process: subprocess.Popen
    router: str
    replicas: dict[str, tuple[str, int]]  # name -> (url, pid)
    log_dir: Path

    def client(self) -> openai.OpenAI:
        # no client retries: every failure is the router's to hide or to show
        return openai.OpenAI(base_url=f"{self.router}/v1", api_key="unused", max_retries=0)


def free_port_pair() -> int:
    """A free port whose successor is free too (the router's Prometheus exporter), below
    the kernel's ephemeral range: a port the kernel hands out itself could go to one of the
    replicas (they bind port 0) or another test's server before the router binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    generator = random.Random()
    while True:
        port = generator.randrange(max(1024, low - 8000), low - 1)
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def stat(pid: int | str) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, ...; [] for no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def descendants(pid: int) -> set[int]:
    """Every process below `pid`."""
    parents = {int(p.name): stat(p.name)[1:2] for p in Path("/proc").iterdir() if p.name.isdigit()}
    found, frontier = set(), {str(pid)}
    while frontier:
        children = {child for child, parent in parents.items() if set(parent) & frontier}
        found |= children
        frontier = {str(child) for child in children}
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    return stat(pid)[:1] not in ([], ["Z"])


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (alive := {p for p in pids if running(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def read_ready(process: subprocess.Popen, timeout: float) -> list[str]:
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline().decode()
        if not line:
            break
        lines.append(line.strip())
        if "ready" in line:
            return lines
    raise RuntimeError(f"cadence replicas not ready: exit {process.poll()}, printed {lines}")


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    port = free_port_pair()
    command = [
        sys.executable, "-m", "ops.replicas", "-n", "2", "--port", "0",
        "--router-port", str(port), "--router-metrics-port", str(port + 1),
        "--policy", "round_robin", "--log-dir", str(tmp_path),
        *(f"--router-arg={arg}" for arg in ROUTER_ARGS),
        "--", "--dtype", "float32", "--device", "cpu", "--kv-memory", str(SMALL_KV_BYTES),
        "--cache-dir", str(cache_dir()),
    ]  # fmt: skip
    stderr = open(tmp_path / "replicas.stderr", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr)
    try:
        lines = read_ready(process, STARTUP_SECONDS)
        (router,) = [re.match(r"router: (\S+)", line)[1] for line in lines if "router:" in line]
        found = [re.match(r"(replica-\d): (\S+) \(pid (\d+)\)", line) for line in lines]
        started = {m[1]: (m[2], int(m[3])) for m in found if m}
        yield Replicas(process, router, started, tmp_path)
    finally:
        family = descendants(process.pid)
        process.send_signal(signal.SIGTERM)  # what Ctrl-C does
        returncode = process.wait(60)
        stderr.close()
        assert returncode == 0, (tmp_path / "replicas.stderr").read_text()[-3000:]
        assert not wait_gone(family, 10.0), "a child of cadence replicas outlived it"


def gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families[name].samples[0].value


def received(url: str) -> float:
    return gauge(url, "cadence:request_received")  # a counter's family drops "_total"


def router_says_healthy(router: str, url: str) -> bool:
    workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    return any(w["url"] == url and w["is_healthy"] for w in workers)


def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.1)


def ask(client: openai.OpenAI, kind: str, max_tokens: int = 8, ignore_eos: bool = False) -> str:
    """One request of each kind the router must pass through; returns its text."""
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
              "extra_body": {"ignore_eos": ignore_eos}}  # fmt: skip
    if kind == "chat":
        reply = client.chat.completions.create(messages=QUESTION, **common)
        return reply.choices[0].message.content or ""
    if kind == "chat-stream":
        stream = client.chat.completions.create(messages=QUESTION, stream=True, **common)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    if kind == "completion":
        return client.completions.create(prompt=PROMPT, **common).choices[0].text
    stream = client.completions.create(prompt=PROMPT, stream=True, **common)
    return "".join(c.choices[0].text for c in stream if c.choices)


KINDS = ("chat", "chat-stream", "completion", "completion-stream")


def test_the_command_is_registered_with_the_cadence_cli() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["cadence.commands"]["replicas"] == "ops.commands:replicas"
    assert any(r.startswith("sglang-router") for r in project["optional-dependencies"]["router"])
    assert LISTENING.decode() in (REPO_ROOT / "service" / "server.py").read_text()


def test_two_replicas_share_the_load_and_one_survives_the_others_death(
    replicas: Replicas,
) -> None:
    client = replicas.client()
    (url0, _), (url1, pid1) = replicas.replicas["replica-0"], replicas.replicas["replica-1"]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: ask(client, KINDS[i % 4]), range(32)))
    assert all(texts), texts
    served = received(url0), received(url1)
    assert min(served) > 0 and sum(served) == 32, served  # round_robin: 16 each

    # Two long streams on each replica; one replica dies under its two, and new requests
    # come at once, before a health check can notice.
    with ThreadPoolExecutor(12) as pool:
        in_flight = [pool.submit(ask, client, "chat-stream", 96, True) for _ in range(4)]
        wait_for(lambda: gauge(url1, "cadence:num_requests_running") == 2, 30.0)
        worker_pids = descendants(pid1)
        os.kill(pid1, signal.SIGKILL)
        after = [pool.submit(ask, client, KINDS[i % 4]) for i in range(8)]
        errors = [f.exception() for f in in_flight]
        assert all(f.result() for f in after)  # the router retried them on the live one
    # The router does not replay a request it has begun to answer: the client sees the
    # stream cut. The survivor's streams finish.
    assert [e is None for e in errors].count(True) == 2, errors
    assert not wait_gone(worker_pids, 10.0), "the killed replica's worker lived on"

    # The router notices within a few health checks; from then on every request succeeds,
    # all on the survivor.
    wait_for(lambda: not router_says_healthy(replicas.router, url1), NOTICE_SECONDS)
    before = received(url0)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: ask(client, KINDS[i % 4]), range(16)))
    assert all(texts), texts
    assert received(url0) - before == 16
