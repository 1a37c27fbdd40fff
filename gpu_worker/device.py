"""Which device and dtype the worker runs on, and how much memory is free there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the driver's folder per GPU it sees
SMI_TIMEOUT_S = 10.0


def resolve_device(name: str) -> torch.device:
    """ "auto" -> the first CUDA device when there is one, else the CPU. A CUDA device gets
    its index and becomes the process's current device: streams, graph captures and the
    allocator use the current device, not the one a tensor names (`cuda:1` would otherwise
    capture on device 0's stream)."""
    device = _parse_device(name)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    return device


def _parse_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but {_why_no_cuda()}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use auto, cpu or cuda[:N]")
    return device


def unusable_gpu_warning(name: str) -> str | None:
    """For "auto" on a host whose GPU this torch cannot use (most often a CPU build of torch):
    the warning to give, since the worker would otherwise serve on the CPU without a word."""
    if name != "auto" or torch.cuda.is_available() or not gpu_visible():
        return None
    return (
        f"a GPU is visible but {_why_no_cuda()}: serving on the CPU. See the README's "
        "'Running on a GPU', or pass --device cpu to mean it."
    )


def gpu_visible() -> bool:
    """Whether the NVIDIA driver sees a GPU, asked without CUDA: its /proc entries, else
    `nvidia-smi -L`."""
    if NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU " in listed.stdout


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU "
        "(a driver too old for that CUDA, or CUDA_VISIBLE_DEVICES?)"
    )


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on the device now: CUDA's own count, or MemAvailable on a CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _mem_available(Path("/proc/meminfo"))


def _mem_available(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemAvailable line in {meminfo}")
