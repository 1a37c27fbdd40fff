"""The tensor-parallel worker group: rank 0 (the worker the service started) and its
followers, started, fed and ended as one worker.

vLLM's multiprocess executor's shape, on torch.distributed alone. Rank 0 creates the
rendezvous store (a TCPStore on loopback, on a port the system picks), spawns ranks
1..N-1 as `python -m gpu_worker.follower` (gpu_worker.follower) and joins them in two
process groups:
- the control group (gloo, the default group) carries every message rank 0 receives
  (the init, each plan, the pings, the shutdown) and the start-up's agreements (the
  kernels, the block count, each rank's facts). Followers wait inside it between plans,
  so its timeout is long;
- the data group (gloo on a CPU, NCCL on CUDA) carries the model's collectives
  (gpu_worker.tensor_parallel), with a timeout under the service's step timeout: a rank
  that exits fails its peers' next collective at once, one that stops fails it when the
  timeout passes, and rank 0 reports either as "fatal" (gpu_worker.faults.GroupFault).
The service pings an idle worker every second (service.engine.supervision); rank 0 turns
each ping into a heartbeat on the data group, so a rank lost while idle is found as soon.

Followers die with rank 0 (PR_SET_PDEATHSIG, gpu_worker.process), however it ends, and
rank 0 reaps them when it exits. A follower can also be started by hand against a
leader's store (vLLM's headless mode); this file starts them on rank 0's host.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import orjson
import torch
import torch.distributed as dist

from gpu_worker.tensor_parallel import Shard

STORE_HOST = "127.0.0.1"
CPU = torch.device("cpu")
# Followers wait for the next plan inside the control group. An idle service pings every
# second, so a long wait there means the service itself is stuck; its own watchdog ends
# rank 0, and with it the followers.
CONTROL_TIMEOUT = timedelta(days=1)
JOIN_TIMEOUT = timedelta(minutes=5)  # a follower's start: importing torch, connecting
FOLLOWER_STOP_TIMEOUT_S = 5.0
FAILURE_KEY = "failed/{rank}"  # a follower's start-up error, for rank 0's message


@dataclass(slots=True)
class Group:
    """This process's rank of the group, its two process groups, and on rank 0 the
    followers it started."""

    shard: Shard  # the data group's: what the model's collectives run on
    store: dist.Store
    device: torch.device = CPU  # this rank's (place)
    followers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    broken: bool = False  # rank 0 saw the group fail: nothing more is sent on it

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.world_size

    @classmethod
    def lead(cls, world_size: int, backend: str, collective_timeout: float) -> Group:
        """Rank 0: the store, the followers spawned, both process groups joined."""
        store = dist.TCPStore(
            STORE_HOST,
            0,
            world_size,
            is_master=True,
            timeout=JOIN_TIMEOUT,
            wait_for_workers=False,
        )
        address = f"{STORE_HOST}:{store.port}"
        followers = [
            subprocess.Popen(
                follower_command(address, rank, world_size, backend, collective_timeout)
            )
            for rank in range(1, world_size)
        ]
        try:
            group = cls._joined(store, 0, world_size, backend, collective_timeout)
        except BaseException:
            _end(followers)
            raise
        group.followers = followers
        return group

    @classmethod
    def join(
        cls, address: str, rank: int, world_size: int, backend: str, collective_timeout: float
    ) -> Group:
        """A follower: rank `rank` of the group whose store listens at `address`."""
        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=JOIN_TIMEOUT)
        return cls._joined(store, rank, world_size, backend, collective_timeout)

    @classmethod
    def _joined(
        cls,
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: str,
        collective_timeout: float,
    ) -> Group:
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=CONTROL_TIMEOUT
        )
        data = dist.new_group(backend=backend, timeout=timedelta(seconds=collective_timeout))
        return cls(Shard.of(data), store)

    def place(self, device: torch.device) -> torch.device:
        """This rank's device: on CUDA the device `rank` places after `device`; on a CPU
        the same one, with this rank's share of the cores for its threads (the ranks
        share the host's)."""
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + self.rank)
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.world_size))
        self.device = device
        return device

    # ---- the control group: messages and agreements --------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        """Rank 0: `message` to every follower (each receives it)."""
        data = orjson.dumps(message)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.long), src=0)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)

    def receive(self) -> dict[str, Any]:
        """A follower: the next message rank 0 sends."""
        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, src=0)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=0)
        return orjson.loads(data.numpy().tobytes())

    def share(self, value: Any) -> Any:
        """Rank 0's `value` (JSON types) on every rank; the others pass None."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def least(self, count: int) -> int:
        """The least of every rank's `count`."""
        tensor = torch.tensor([count], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` on rank 0, in rank order; [] on the others."""
        found: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, found, dst=0)
        return found or []

    # ---- the data group --------------------------------------------------------------------

    def heartbeat(self) -> None:
        """One collective on the data group: GroupFault unless every rank answers."""
        self.shard.all_reduce(torch.zeros(1, device=self.device))

    # ---- failures and the end --------------------------------------------------------------

    def report_failure(self, message: str) -> None:
        """A follower: why it could not start, for rank 0's "fatal" message."""
        self.store.set(FAILURE_KEY.format(rank=self.rank), message)

    def failures(self) -> str:
        """Rank 0: what went wrong with the followers, as far as it shows: the start-up
        errors they reported, and which of them exited."""
        found = []
        for rank, process in enumerate(self.followers, start=1):
            key = FAILURE_KEY.format(rank=rank)
            if self.store.check([key]):
                found.append(f"rank {rank}: {self.store.get(key).decode()}")
            elif process.poll() is not None:
                found.append(f"rank {rank} (pid {process.pid}) exited with {process.returncode}")
        return "; ".join(found)

    def close(self) -> None:
        """Rank 0: tells the followers to exit (unless the group is broken) and reaps
        them, killing those that linger."""
        if not self.broken:
            try:
                self.send({"type": "shutdown"})
            except RuntimeError:
                self.broken = True  # the followers are ended below
        _end(self.followers, 0.0 if self.broken else FOLLOWER_STOP_TIMEOUT_S)
        if not self.broken:
            dist.destroy_process_group()


def follower_command(
    address: str, rank: int, world_size: int, backend: str, collective_timeout: float
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gpu_worker.follower",
        f"--store={address}",
        f"--rank={rank}",
        f"--world-size={world_size}",
        f"--backend={backend}",
        f"--collective-timeout={collective_timeout}",
        f"--parent={os.getpid()}",
    ]


def data_backend(device: torch.device) -> str:
    """The model's collectives' backend: NCCL between GPUs, gloo on a CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def _end(processes: list[subprocess.Popen[bytes]], grace_s: float = 0.0) -> None:
    """Wait up to `grace_s` for each process, kill what is left, reap them all."""
    for process in processes:
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
