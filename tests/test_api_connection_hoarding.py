"""Connections cannot be hoarded: 5,000 raw connections from one client, each holding a
complete request head and no body (then 5,000 that send nothing), held while another
client streams a chat, polls /health and sends requests on new connections.

At the cap (--max-connections, 2048 by default) the server closes the longest-stalled
connections that ask for nothing it is answering, not the newcomer, so the other client
is served: every request 200, its stream's largest gap under 2 s, /health 200 throughout.
A client that closes its side with a body half sent gets no answer (as from nginx): 2,048
such closes at once then cost the event loop half what answering each with a 400 did.
Refusing the newcomer at the cap gave that client 503s (9 of 10 health polls). Afterwards
the hoarders' descriptors are all closed (the head and body timeouts, or eviction) and the
server's descriptors and memory are back where they started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.server_fixtures import REPO_ROOT, RunningServer, served
from tests.test_api_counts import MIB, rss
from tests.test_api_loop_attacks import collector_paused, gaps_of, stream_chat

pytestmark = pytest.mark.real_model
HOARDERS = 5_000
HOLD_S = 10.0  # the issue's
GAP_GOAL_S = 2.0
GAPS_BEFORE = 20  # the stream's pace is measured over this many chunks first
HEAD = (
    "POST /v1/completions HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nContent-Type: application/json"
    "\\r\\nContent-Length: 1000\\r\\n\\r\\n"
)  # as the hoarder's command line takes it
MEMORY_BOUND = 128 * MIB  # what stays of 2,048 connections' buffers in the allocator


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # The hoarders' own process runs on this machine's two cores, beside the server: the
    # worker leaves one to the front end, as a deployment facing such clients would (without
    # it, a 22 ms decode step took 270-420 ms while the hoarders connected; --cpu-threads)
    yield from served(tmp_path_factory, "hoarded", "--cpu-threads", "1")


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def hoard(url: str, head: str) -> None:
    """HOARDERS connections from a process of their own, each sending `head`, held
    HOLD_S once open."""
    command = [sys.executable, "-m", "tests.hoard_connections", url, str(HOARDERS), str(HOLD_S)]
    process = await trio.lowlevel.open_process(
        [*command, head] if head else command, stdout=subprocess.PIPE, cwd=REPO_ROOT
    )
    assert process.stdout is not None
    line = await process.stdout.receive_some(100)
    assert line.startswith(b"ready"), line
    await process.wait()
    assert process.returncode == 0


async def poll(url: str, model: str, statuses: list[tuple[str, int]], done: trio.Event) -> None:
    """/health and a short completion, each on a new connection, until `done`."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        while not done.is_set():
            health = await client.get("/health")
            statuses.append(("health", health.status_code))
            body = {"model": model, "prompt": "Hello", "max_tokens": 2}
            statuses.append(
                ("completion", (await client.post("/v1/completions", json=body)).status_code)
            )
            await trio.sleep(0.5)


@pytest.mark.parametrize("head", [HEAD, ""], ids=["head_without_body", "nothing"])
async def test_hoarded_connections_leave_other_clients_served(
    server: RunningServer, head: str
) -> None:
    pid = server.process.pid
    await trio.sleep(1.0)  # the start's own connections are gone
    fds, memory = descriptors(pid), rss(pid)
    arrivals: list[float] = []
    statuses: list[tuple[str, int]] = []
    done = trio.Event()
    client = httpx.AsyncClient(base_url=server.url, timeout=120)
    with collector_paused():
        async with client, trio.open_nursery() as nursery:
            nursery.start_soon(stream_chat, client, server.model, arrivals)
            while len(arrivals) < GAPS_BEFORE:
                await trio.sleep(0.05)
            before = max(gaps_of(arrivals))
            nursery.start_soon(poll, server.url, server.model, statuses, done)
            await hoard(server.url, head)
            done.set()
            count = len(arrivals)
            while len(arrivals) < count + 2:  # a gap that spans the end counts too
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    gaps = gaps_of(arrivals)
    refused = [s for s in statuses if s[1] != 200]
    print(
        f"{len(statuses)} requests beside {HOARDERS} hoarders, not 200: {refused}; the "
        f"stream's largest gap {max(gaps):.3f} s over {len(gaps)} chunks ({before:.3f} s "
        f"before the hoarders)"
    )
    assert not refused and statuses
    # as tests/test_api_loop_attacks.py: beyond the stream's own worst gap on this machine
    # now (a loaded machine's noise is not the hoarders'), a freeze of seconds is
    assert max(gaps) < GAP_GOAL_S + before
    deadline = time.monotonic() + 30
    while descriptors(pid) > fds and time.monotonic() < deadline:
        await trio.sleep(0.2)
    print(f"descriptors {fds} -> {descriptors(pid)}; memory +{(rss(pid) - memory) / MIB:.1f} MiB")
    assert descriptors(pid) <= fds
    assert rss(pid) - memory < MEMORY_BOUND
    assert Path(f"/proc/{pid}").exists()


async def test_a_body_abandoned_half_sent_is_closed_unanswered(server: RunningServer) -> None:
    """The client ends its side 10 bytes into a 1,000-byte body: the server closes the
    connection without answering (nginx's "client prematurely closed connection"; Hypercorn
    alone answered a 400 into it)."""
    host, port = server.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(HEAD.replace("\\r\\n", "\r\n").encode() + b'{"model": ')
    await stream.send_eof()
    with trio.fail_after(10):
        assert await stream.receive_some(4096) == b""
    await stream.aclose()


def test_the_worker_leaves_the_front_end_a_core(server: RunningServer) -> None:
    """--cpu-threads reaches the worker's model work (its handshake's rank facts)."""
    (started,) = server.log_events("worker.started")
    assert [rank["threads"] for rank in started["ranks"]] == [1]
