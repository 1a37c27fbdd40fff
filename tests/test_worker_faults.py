"""A step's device error ends the worker (after it says why); any other error is the step's
alone and the worker keeps serving. Device errors are faked: no GPU is needed."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

import gpu_worker.__main__ as worker_main
from gpu_worker.faults import is_device_fault
from gpu_worker.protocol import DEVICE_ERROR, to_message
from tests.test_worker_process import TIMEOUT, ServiceSide
from tests.worker_fixtures import (
    Chunk,
    blocks_for,
    make_plan,
    make_runner,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    random_prompt,
    tiny_llama_dir,  # noqa: F401 (fixture)
)

ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize(
    ("error", "fatal"),
    [
        (torch.AcceleratorError(ILLEGAL_ACCESS), True),
        (RuntimeError(ILLEGAL_ACCESS), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("shape '[4, 8]' is invalid for input of size 30"), False),
        (ValueError("block 10000 is out of range"), False),
    ],
)
def test_device_errors_are_told_from_the_others(error: Exception, fatal: bool):
    assert is_device_fault(error) is fatal


def failing_forward(error: Exception):
    def forward(*args, **kwargs):
        raise error

    return forward


def prefill(step_id: int):
    return make_plan([Chunk(0, random_prompt(6, seed=1), 0, blocks_for(0, 6))], step_id=step_id)


class LoopThread:
    """A WorkerLoop around a real runner, served in a thread, and the service's end."""

    def __init__(self, runner) -> None:
        service_end, self.worker_end = socket.socketpair()
        self.loop = worker_main.WorkerLoop(self.worker_end)
        self.loop.runner = runner
        self.status: list[int] = []
        self.thread = threading.Thread(target=lambda: self.status.append(self.loop.serve()))
        self.thread.start()
        self.service = ServiceSide(service_end)

    def exit_status(self) -> int | None:
        self.thread.join(TIMEOUT)
        return self.status[0] if self.status else None

    def close(self) -> None:
        self.service.sock.close()
        self.thread.join(TIMEOUT)
        self.worker_end.close()


@pytest.fixture
def served(tiny_llama_dir):  # noqa: F811
    loop = LoopThread(make_runner(tiny_llama_dir))
    yield loop
    loop.close()


def test_a_device_error_in_a_step_is_reported_fatal_and_ends_the_worker(served, monkeypatch):
    assert served.service.step(prefill(1)).error is None
    model = served.loop.runner.model
    monkeypatch.setattr(model, "forward", failing_forward(RuntimeError(ILLEGAL_ACCESS)))
    served.service.send(to_message("step", prefill(2)))
    fatal = served.service.receive()
    assert fatal["type"] == "fatal" and fatal["reason"] == DEVICE_ERROR
    assert "step 2" in fatal["message"] and ILLEGAL_ACCESS in fatal["message"]
    assert served.exit_status() == worker_main.EXIT_DEVICE_FAULT


def test_another_error_in_a_step_fails_that_step_only(served, monkeypatch):
    model = served.loop.runner.model
    forward = model.forward
    monkeypatch.setattr(model, "forward", failing_forward(ValueError("a bad plan")))
    failed = served.service.step(prefill(1))
    assert failed.step_id == 1 and failed.error == "ValueError: a bad plan"
    monkeypatch.setattr(model, "forward", forward)
    again = served.service.step(prefill(2))
    assert again.error is None and [len(row) for row in again.tokens] == [1]
    assert served.thread.is_alive()
