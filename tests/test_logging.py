"""Logs that cannot grow without bound nor stop the server.

A --log-file rotates into at most backups + 1 files of whole JSON lines. On stderr, a pipe or
socket nobody reads must not block the process: the child processes here log far more than a
pipe holds, and the test only reads their stderr once they say they are done.
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import structlog

from service.logging import configure_logging
from tests.server_fixtures import REPO_ROOT

DEADLINE_S = 60  # today's logging takes ~4 s for 200,000 lines; blocked, it never ends

# Logs LINES lines, says "done" on stdout (with fd 2's O_NONBLOCK bit, its own and a child's),
# then logs one "after" line per line read from stdin, answering "ok" for each.
CHILD = """
import fcntl, os, subprocess, sys
import structlog
from service.logging import configure_logging

configure_logging(None)
log = structlog.get_logger()
for i in range({lines}):
    log.info("load", i=i)
flag = "import fcntl, os; print(fcntl.fcntl(2, fcntl.F_GETFL) & os.O_NONBLOCK)"
child = subprocess.run([sys.executable, "-c", flag], stdout=subprocess.PIPE)
print("done", fcntl.fcntl(2, fcntl.F_GETFL) & os.O_NONBLOCK, int(child.stdout), flush=True)
for _ in sys.stdin:
    log.info("after")
    print("ok", flush=True)
"""


def start_child(lines: int, stderr: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD.format(lines=lines)],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )


def read_line_within(child: subprocess.Popen, seconds: float) -> bytes:
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], seconds)
    if not ready:
        child.kill()
        raise AssertionError(f"no answer from the child in {seconds} s: its logging blocked")
    return child.stdout.readline()


def events(data: bytes) -> list[dict]:
    assert data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]  # each line whole JSON


def log_numbered_lines(count: int) -> None:
    log = structlog.get_logger()
    for i in range(count):
        log.info("line", i=i, pad="x" * 40)


def test_a_log_file_rotates_into_at_most_backups_plus_one_files_of_whole_lines(tmp_path: Path):
    log_file = tmp_path / "server.jsonl"
    configure_logging(log_file, "info", max_bytes=4096, backups=2)
    try:
        log_numbered_lines(1000)
    finally:
        configure_logging(None, "info")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "server.jsonl",
        "server.jsonl.1",
        "server.jsonl.2",
    ]
    oldest_first = [tmp_path / "server.jsonl.2", tmp_path / "server.jsonl.1", log_file]
    numbers = []
    for path in oldest_first:
        data = path.read_bytes()
        assert len(data) <= 4096
        numbers += [event["i"] for event in events(data)]
    assert numbers == list(range(numbers[0], 1000))  # the newest lines, none lost or split
    line_bytes = len(log_file.read_bytes().splitlines()[0]) + 1
    assert all(p.stat().st_size > 4096 - line_bytes for p in oldest_first[:2])  # files filled


def test_without_backups_a_full_log_file_starts_over(tmp_path: Path):
    log_file = tmp_path / "server.jsonl"
    configure_logging(log_file, "info", max_bytes=1000, backups=0)
    try:
        log_numbered_lines(50)
    finally:
        configure_logging(None, "info")
    assert [p.name for p in tmp_path.iterdir()] == ["server.jsonl"]
    assert log_file.stat().st_size <= 1000
    assert events(log_file.read_bytes())[-1]["i"] == 49


def test_a_line_longer_than_max_bytes_is_written_whole_in_a_file_of_its_own(tmp_path: Path):
    log_file = tmp_path / "server.jsonl"
    configure_logging(log_file, "info", max_bytes=200, backups=3)
    try:
        log = structlog.get_logger()
        log.info("short")
        log.info("long", text="y" * 500)
        log.info("short again")
    finally:
        configure_logging(None, "info")
    files = [tmp_path / "server.jsonl.2", tmp_path / "server.jsonl.1", log_file]
    assert [[e["event"] for e in events(p.read_bytes())] for p in files] == [
        ["short"],
        ["long"],
        ["short again"],
    ]


def test_a_pipe_nobody_reads_does_not_stop_logging_and_drops_are_reported():
    child = start_child(200_000, stderr=subprocess.PIPE)
    received: list[bytes] = []
    try:
        assert read_line_within(child, DEADLINE_S).startswith(b"done")
        reader = threading.Thread(target=lambda: received.extend(child.stderr), daemon=True)
        reader.start()  # the pipe is read from now on: what was kept for later goes out
        rounds = 0
        while rounds < 1000 and not any(b'"log.dropped"' in line for line in received):
            rounds += 1  # one more line logged, to give the child a write to send them with
            child.stdin.write(b"log\n")
            child.stdin.flush()
            assert read_line_within(child, DEADLINE_S) == b"ok\n"
        child.stdin.close()
        assert child.wait(DEADLINE_S) == 0
        reader.join(DEADLINE_S)
    finally:
        child.kill()
    logged = events(b"".join(received))
    dropped = sum(e["lines"] for e in logged if e["event"] == "log.dropped")
    loads = [e["i"] for e in logged if e["event"] == "load"]
    afters = sum(e["event"] == "after" for e in logged)
    assert dropped > 0 and loads == sorted(loads)
    # each line logged either arrived or is counted in a log.dropped line
    assert len(loads) + afters + dropped == 200_000 + rounds


def test_fd_2_stays_blocking_for_the_process_and_its_children():
    # The logger's own description of the pipe does not block; fd 2, shared with the worker
    # and any child, keeps its flags (children may not expect EAGAIN on stderr).
    child = start_child(5_000, stderr=subprocess.PIPE)  # more than the pipe holds
    try:
        assert read_line_within(child, DEADLINE_S) == b"done 0 0\n"
    finally:
        child.kill()


def test_a_socket_nobody_reads_does_not_stop_logging():
    # journald gives services a socket for stderr; it cannot be reopened non-blocking
    ours, theirs = socket.socketpair()
    child = start_child(50_000, stderr=theirs.fileno())
    theirs.close()
    try:
        assert read_line_within(child, DEADLINE_S).startswith(b"done")
        child.stdin.close()
        assert child.wait(DEADLINE_S) == 0
        data = b"".join(iter(lambda: ours.recv(1 << 16), b""))
    finally:
        child.kill()
        ours.close()
    first = events(data[: data.index(b"\n") + 1])[0]
    assert (first["event"], first["i"]) == ("load", 0)
