"""Copies between the host and a CUDA device that do not stall the host on the device's queue.

Sampling runs while the device still works through the step's forward pass. A copy from
pageable host memory waits for that work: torch synchronises the stream after a blocking
one, and the driver may stage a non-blocking one through a wait of its own. From pinned
memory a non-blocking copy is queued behind the kernels already launched and the host moves
on; the caching host allocator keeps the pinned block until the copies that use it are done,
so a block dropped right after its copy is not reused too early. A step's sampling then
waits for the device once, where it reads the tokens back (to_host_list).

On other devices (the CPU) these are the plain copies.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; on CUDA through pinned memory, without waiting."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host_list(values: torch.Tensor) -> list[Any]:
    """values.tolist(); on CUDA copied into pinned memory behind the queued kernels, and
    read once an event recorded after the copy has passed."""
    if values.device.type != "cuda":
        return values.tolist()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))
    copied.synchronize()
    return host.tolist()
