"""Which device and dtype the worker runs on, and how much memory is free there."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """ "auto" -> the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use auto, cpu or cuda[:N]")
    return device


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
