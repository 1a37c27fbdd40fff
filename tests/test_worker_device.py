"""The worker's device: a CUDA device becomes the process's current one, and "auto" on a
host whose GPU torch cannot use warns instead of falling back to the CPU silently. CUDA is
faked: no GPU is needed."""

from __future__ import annotations

import socket

import pytest
import torch

import gpu_worker.__main__ as worker_main
from gpu_worker import device as device_module
from gpu_worker.device import resolve_device, unusable_gpu_warning
from tests.test_worker_process import ServiceSide, init_message


class FakeCuda:
    """What resolve_device asks of torch.cuda on a host with two GPUs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.current = 0
        self.set_calls: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, index: int) -> None:
        self.set_calls.append(index)
        self.current = index


@pytest.mark.parametrize(
    ("name", "index"), [("cuda:1", 1), ("cuda:0", 0), ("cuda", 0), ("auto", 0)]
)
def test_a_cuda_device_is_made_current_with_its_index(monkeypatch, name: str, index: int):
    cuda = FakeCuda(monkeypatch)
    assert resolve_device(name) == torch.device("cuda", index)
    assert cuda.set_calls == [index]


def test_the_cpu_sets_no_cuda_device(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    assert resolve_device("cpu") == torch.device("cpu")
    assert cuda.set_calls == []


def without_cuda(monkeypatch, *, gpu_seen: bool, build: str | None = None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", build)
    monkeypatch.setattr(device_module, "gpu_visible", lambda: gpu_seen)


def test_auto_on_a_gpu_host_with_a_cpu_torch_warns(monkeypatch):
    without_cuda(monkeypatch, gpu_seen=True)
    warning = unusable_gpu_warning("auto")
    assert warning is not None
    assert "without CUDA" in warning and "serving on the CPU" in warning
    assert resolve_device("auto") == torch.device("cpu")  # it still serves


def test_a_cuda_torch_that_finds_no_gpu_says_so(monkeypatch):
    without_cuda(monkeypatch, gpu_seen=True, build="13.0")
    assert "CUDA 13.0" in unusable_gpu_warning("auto")
    with pytest.raises(ValueError, match="driver"):
        resolve_device("cuda")


@pytest.mark.parametrize(("name", "gpu_seen"), [("auto", False), ("cpu", True)])
def test_no_warning_without_a_gpu_or_with_the_cpu_asked_for(monkeypatch, name, gpu_seen):
    without_cuda(monkeypatch, gpu_seen=gpu_seen)
    assert unusable_gpu_warning(name) is None


def test_a_gpu_is_seen_in_the_drivers_proc_entries(monkeypatch, tmp_path):
    monkeypatch.setattr(device_module, "NVIDIA_GPUS", tmp_path)
    monkeypatch.setattr(device_module.shutil, "which", lambda name: None)
    assert not device_module.gpu_visible()  # the driver is loaded, but sees no GPU
    (tmp_path / "0000:18:00.0").mkdir()
    assert device_module.gpu_visible()


def test_a_gpu_is_seen_by_nvidia_smi(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(device_module, "NVIDIA_GPUS", tmp_path / "absent")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert device_module.gpu_visible()
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert not device_module.gpu_visible()


def test_the_worker_logs_the_warning_and_hands_it_to_the_service(
    monkeypatch,
    capfd,
    tiny_llama_dir,
):
    monkeypatch.setattr(device_module, "unusable_gpu_warning", lambda name: f"no GPU for {name}")
    service_end, worker_end = socket.socketpair()
    with service_end, worker_end:
        loop = worker_main.WorkerLoop(worker_end)
        # the warning is faked, so the model may load on the CPU
        init = init_message(tiny_llama_dir, device="cpu")
        assert loop.handle(init) is None
        ready = ServiceSide(service_end).receive()
    assert ready["type"] == "ready" and ready["device_warning"] == "no GPU for cpu"
    assert "gpu_worker: WARNING: no GPU for cpu" in capfd.readouterr().err
