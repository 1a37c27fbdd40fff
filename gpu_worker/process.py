"""What every worker process sets up, rank 0 (gpu_worker.__main__) and its followers
(gpu_worker.follower) alike: its log lines, its heap, and a follower's death with its
parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
EXIT_DEVICE_FAULT = 3  # the exit status after a step left the worker unusable


def log(message: str, rank: int = 0) -> None:
    """One line on stderr, which the service's own stderr shows."""
    name = "gpu_worker" if rank == 0 else f"gpu_worker rank {rank}"
    print(f"{name}: {message}", file=sys.stderr, flush=True)


def keep_freed_memory() -> None:
    """Every step allocates and frees the same large tensors (logits, gather buffers). By
    default glibc gives such blocks back to the kernel, so every step pays page faults for
    them again (sampling's cost roughly triples). Keep them in the heap."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)  # glibc's largest accepted value
    libc.mallopt(_M_TRIM_THRESHOLD, 1024 * 1024 * 1024)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the process that started it (`parent_pid`) ends, however
    it ends; exit now if it already has (it may end before this runs)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError as exc:
        raise RuntimeError("a follower rank needs Linux's prctl to die with rank 0") from exc
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(0)  # rank 0 is gone already: nobody would ever send a plan
