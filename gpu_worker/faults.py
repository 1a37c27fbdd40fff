"""Which step failures leave the device unusable, so that the worker must exit.

A CUDA error is sticky: once a kernel has faulted (an illegal address, a device-side
assert), every later call on that context fails too, and only a new process gets a working
device. A worker that reported such an error and kept serving would fail every step while
looking alive; so the step's error ends the worker instead (gpu_worker.__main__), and the
service restarts it, failing only the requests of that step (service.engine.engine).
Kernels run asynchronously, so the error may surface at a later call of the step (the
sampler's copy to the host) than the kernel that faulted: the whole step is judged.

A tensor-parallel group's lost rank is one too (GroupFault): a rank that died or stopped
leaves its peers' collectives failing or timing out, and only a new group serves again.

Out of memory is not such an error: the caching allocator raises it before any kernel runs,
the context stays valid, and a smaller step fits again; a restart would reload the weights
only to meet the same memory. It stays a step error, like a bad plan.
"""

from __future__ import annotations

import torch

from gpu_worker.protocol import DEVICE_ERROR, RANK_HUNG, RANK_LOST

# Messages of the RuntimeErrors that CUDA, cuBLAS and cuDNN failures surface as, in torch
# builds whose errors have no type of their own.
DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "device-side assert",
    "illegal memory access",
)


class DeviceFault(RuntimeError):
    """A step failed in a way that leaves the device unusable; the worker must exit."""

    @property
    def reason(self) -> str:
        """The "fatal" message's reason (gpu_worker.protocol)."""
        return DEVICE_ERROR


class GroupFault(DeviceFault):
    """A collective across the tensor-parallel ranks failed: a rank exited (its peers see
    the connection close) or stopped answering (the collective timed out)."""

    @property
    def reason(self) -> str:
        return RANK_HUNG if "timed out" in str(self).lower() else RANK_LOST


def device_error_types() -> tuple[type[BaseException], ...]:
    """torch's own types for accelerator failures, where this torch has them."""
    names = [(torch, "AcceleratorError"), (torch.cuda, "CudaError")]
    return tuple(getattr(module, name) for module, name in names if hasattr(module, name))


def is_device_fault(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, device_error_types()):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and any(m in message for m in DEVICE_ERROR_MARKERS)
