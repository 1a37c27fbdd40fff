"""The reference kernels run on any device: one mixed step of the PyTorch backend, traced
operator by operator, calls nothing that exists for CPUs only (issue 14's B1 was such a
call, which raised on CUDA and failed every request of the step)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_worker.attention import torch_backend
from tests.worker_fixtures import (  # noqa: F401 (fixture)
    Chunk,
    make_plan,
    make_runner,
    random_prompt,
    tiny_llama_dir,
)

# Operators with no kernel but the CPU's: PyTorch's CPU-only variants, oneDNN's, and the
# C++ kernels of gpu_worker.native.
CPU_ONLY_MARKS = ("_cpu", "cpu_", "mkldnn", "onednn", "cadence::")


class OperatorLog(TorchDispatchMode):
    """Records the name of every operator dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def cpu_only(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(mark in n for mark in CPU_ONLY_MARKS))


def traced_mixed_step(model_dir) -> set[str]:
    """A prefill chunk at a cached offset beside two decode rows, sampled, traced."""
    runner = make_runner(
        model_dir, kernels="attention=torch,layer_ops=torch,matmul=aten", kernel_cache=""
    )
    prompt = random_prompt(30, seed=1)
    for chunk in (Chunk(0, prompt[:17], 0, list(range(8))), Chunk(1, [7] * 9, 0, [20, 21, 22])):
        assert runner.execute(make_plan([chunk])).error is None
    plan = make_plan(
        [
            Chunk(1, [5], 9, [20, 21, 22]),
            Chunk(0, prompt[17:], 17, list(range(8))),
            Chunk(2, [9], 0, [30]),
        ]
    )
    with OperatorLog() as log:
        result = runner.execute(plan)
    assert result.error is None, result.error
    return log.names


def as_on_cuda(original):
    """The reference's choice of prefill kernel as a CUDA device gets it."""

    def choose(device, chunk, kv):
        return original(torch.device("cuda"), chunk, kv)

    return choose


@pytest.mark.parametrize("flash_min_context", [torch_backend.FLASH_MIN_CONTEXT, 0])
def test_one_mixed_step_of_the_reference_calls_no_cpu_only_operator(
    tiny_llama_dir,  # noqa: F811
    monkeypatch,
    flash_min_context,
):
    # With no threshold, every chunk would take the CPU flash kernel, were this a CPU; the
    # trace follows the branch a CUDA device takes instead.
    monkeypatch.setattr(torch_backend, "FLASH_MIN_CONTEXT", flash_min_context)
    monkeypatch.setattr(
        torch_backend, "cpu_flash_serves", as_on_cuda(torch_backend.cpu_flash_serves)
    )
    names = traced_mixed_step(tiny_llama_dir)
    assert "aten::bmm" in names  # the trace saw the attention
    assert cpu_only(names) == [], f"CPU-only operators in a device-agnostic step: {cpu_only(names)}"


def test_the_trace_names_a_cpu_only_operator_when_one_runs(tiny_llama_dir, monkeypatch):  # noqa: F811
    """The check bites: the CPU's own branch of the reference takes the flash kernel."""
    monkeypatch.setattr(torch_backend, "FLASH_MIN_CONTEXT", 0)
    names = traced_mixed_step(tiny_llama_dir)
    assert cpu_only(names) == ["aten::_scaled_dot_product_flash_attention_for_cpu"]
