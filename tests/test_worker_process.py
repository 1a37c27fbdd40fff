"""The worker as its own process: `python -m gpu_worker --fd N` over a socketpair."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import pytest

import gpu_worker.__main__ as worker_main
from gpu_worker.protocol import (
    FrameDecoder,
    Handshake,
    StepResult,
    WorkerConfig,
    encode_frame,
    record_from_message,
    step_result_from_message,
    to_message,
)
from tests.worker_fixtures import (
    Chunk,
    blocks_for,
    make_plan,
    random_prompt,
    sampled,
)

TIMEOUT = 120.0


class ServiceSide:
    """The service's side of the channel, written with blocking sockets for the test."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(TIMEOUT)
        self.sock = sock
        self.decoder = FrameDecoder()
        self.pending: deque[dict[str, Any]] = deque()

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(msg))

    def receive(self) -> dict[str, Any]:
        while not self.pending:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("worker closed the channel")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.popleft()

    def step(self, plan) -> StepResult:
        self.send(to_message("step", plan))
        msg = self.receive()
        assert msg["type"] == "result"
        return step_result_from_message(msg)


class WorkerProcess(ServiceSide):
    """`python -m gpu_worker` at the other end."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        # One thread: the tiny model gains nothing from more, and the test machine is shared.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpu_worker", "--fd", str(child.fileno())],
            pass_fds=(child.fileno(),),
            env=env,
        )
        child.close()
        super().__init__(parent)

    def close(self) -> None:
        self.sock.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def worker():
    process = WorkerProcess()
    yield process
    process.close()


def init_message(model_dir, **overrides) -> dict[str, Any]:
    config = WorkerConfig(
        model_dir=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        kv_memory=float(1 << 20),
        max_num_seqs=8,
    )
    for name, value in overrides.items():
        setattr(config, name, value)
    return to_message("init", config)


def test_handshake_steps_errors_and_clean_shutdown(worker, tiny_llama_dir):
    worker.send(init_message(tiny_llama_dir))
    ready = worker.receive()
    assert ready["type"] == "ready", ready
    handshake = record_from_message(Handshake, ready)
    assert handshake.pid == worker.process.pid and handshake.num_blocks > 0

    prompt = random_prompt(20, seed=1)
    table = blocks_for(0, 40)
    first = worker.step(make_plan([Chunk(0, prompt, 0, table)], step_id=1))
    assert first.seq_ids == [0] and len(sampled(first)) == 1

    bad = make_plan([Chunk(0, sampled(first), 20, [10_000])], step_id=2)
    error = worker.step(bad)
    assert error.step_id == 2 and "block" in error.error
    malformed = {"type": "step", "step_id": 3, "seq_ids": [0]}
    worker.send(malformed)
    reply = step_result_from_message(worker.receive())
    assert reply.step_id == 3 and "malformed" in reply.error
    assert worker.process.poll() is None

    tokens = sampled(first)
    decode_times, empty_times = [], []
    for step_id in range(4, 24):
        plan = make_plan([Chunk(0, [tokens[-1]], 19 + len(tokens), table)], step_id=step_id)
        started = time.perf_counter()
        result = worker.step(plan)
        decode_times.append(time.perf_counter() - started)
        assert result.error is None and result.step_id == step_id
        assert result.idle_ms is not None  # sent right after the previous result
        tokens += sampled(result)
        started = time.perf_counter()
        assert worker.step(make_plan([], step_id=1000 + step_id)).error is None
        empty_times.append(time.perf_counter() - started)
    empty_ms = sorted(empty_times)[len(empty_times) // 2] * 1000
    decode_ms = sorted(decode_times)[len(decode_times) // 2] * 1000
    print(
        f"\nworker round trip, median: empty step {empty_ms:.3f} ms, decode step {decode_ms:.3f} ms"
    )

    worker.send({"type": "shutdown"})
    assert worker.process.wait(timeout=TIMEOUT) == 0


def test_failed_init_reports_fatal_and_exits_1(worker, tmp_path):
    worker.send(init_message(tmp_path / "missing"))
    fatal = worker.receive()
    assert fatal["type"] == "fatal" and "missing" in fatal["message"]
    assert worker.process.wait(timeout=TIMEOUT) == 1


def test_a_closed_channel_ends_the_worker(worker, tiny_llama_dir):
    worker.send(init_message(tiny_llama_dir))
    assert worker.receive()["type"] == "ready"
    worker.sock.close()
    assert worker.process.wait(timeout=TIMEOUT) == 0


def test_steps_before_init_are_refused(worker):
    worker.send(to_message("step", make_plan([], step_id=9)))
    reply = step_result_from_message(worker.receive())
    assert reply.step_id == 9 and "before a successful init" in reply.error
    worker.send({"type": "shutdown"})
    assert worker.process.wait(timeout=TIMEOUT) == 0


class InstantRunner:
    """Stands in for the model: answers every plan at once."""

    kv = None  # no KV transfer connector

    def execute(self, plan) -> StepResult:
        return StepResult(step_id=plan.step_id)


def test_each_result_says_how_long_its_plan_kept_the_worker_waiting(monkeypatch):
    service_end, worker_end = socket.socketpair()
    loop = worker_main.WorkerLoop(worker_end)
    loop.runner = InstantRunner()
    thread = threading.Thread(target=loop.serve)
    thread.start()
    service = ServiceSide(service_end)
    try:
        assert service.step(make_plan([], step_id=1)).idle_ms is None  # nothing before it
        time.sleep(0.02)
        assert service.step(make_plan([], step_id=2)).idle_ms > 10
        service.send({"type": "ping"})
        assert service.receive()["type"] == "pong"
        assert service.step(make_plan([], step_id=3)).idle_ms is None  # the service was idle
        monkeypatch.setattr(worker_main, "MAX_IDLE_GAP_S", 0.005)
        time.sleep(0.02)
        assert service.step(make_plan([], step_id=4)).idle_ms is None  # too long: idle too
        service.send({"type": "shutdown"})
        thread.join(TIMEOUT)
    finally:
        service_end.close()
        worker_end.close()
