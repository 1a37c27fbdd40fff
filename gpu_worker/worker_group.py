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

Followers rank 0 starts die with it (PR_SET_PDEATHSIG, gpu_worker.process), however it
ends, and rank 0 reaps them when it exits. With tensor_parallel_size_local K < N it starts
only ranks 1..K-1; the others are started on their own hosts against the store's address
(vLLM's headless mode), and learn the group's GroupSpec from the store.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
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
EXIT_SETTLE_S = 0.5  # how long a failing rank 0 waits to see a killed follower exit
FAILURE_KEY = "failed/{rank}"  # a follower's start-up error, for rank 0's message
SPEC_KEY = "group"  # the GroupSpec, as JSON


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What every rank must agree on before it joins; rank 0 puts it in the store."""

    world_size: int
    backend: str  # the data group's: "gloo" or "nccl"
    collective_timeout: float  # seconds


@dataclass(slots=True)
class Group:
    """This process's rank of the group, its two process groups, and on rank 0 the
    followers it started."""

    shard: Shard  # the data group's: what the model's collectives run on
    store: dist.Store
    spec: GroupSpec
    local_rank: int = 0  # among the ranks on this host: its GPU, its share of the cores
    local_size: int = 1
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
    def lead(
        cls, spec: GroupSpec, address: str | None = None, local_size: int | None = None
    ) -> Group:
        """Rank 0: the store (at `address`, HOST:PORT; None: loopback, a port the system
        picks), ranks 1..local_size-1 spawned here (None: every rank), both process groups
        joined once every rank has, those from elsewhere included."""
        host, port = _host_port(address) if address else (STORE_HOST, 0)
        store = dist.TCPStore(
            host, port, spec.world_size, is_master=True, timeout=JOIN_TIMEOUT,
            wait_for_workers=False,
        )  # fmt: skip
        store.set(SPEC_KEY, orjson.dumps(dataclasses.asdict(spec)).decode())
        local_size = spec.world_size if local_size is None else local_size
        reachable = f"{STORE_HOST if address is None else host}:{store.port}"
        followers = [
            subprocess.Popen(follower_command(reachable, rank, local_size))
            for rank in range(1, local_size)
        ]
        try:
            group = cls._joined(store, 0, spec, 0, local_size)
        except BaseException:
            _end(followers)
            raise
        group.followers = followers
        return group

    @classmethod
    def join(
        cls, address: str, rank: int, local_rank: int | None = None, local_size: int | None = None
    ) -> Group:
        """A follower: rank `rank` of the group whose store listens at `address`;
        `local_rank` among `local_size` ranks on this host (None: as if every rank were)."""
        host, port = _host_port(address)
        store = dist.TCPStore(host, port, is_master=False, timeout=JOIN_TIMEOUT)
        spec = GroupSpec(**orjson.loads(store.get(SPEC_KEY)))
        local = spec.world_size if local_size is None else local_size
        return cls._joined(store, rank, spec, rank if local_rank is None else local_rank, local)

    @classmethod
    def _joined(
        cls, store: dist.Store, rank: int, spec: GroupSpec, local_rank: int, local_size: int
    ) -> Group:
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=spec.world_size, timeout=CONTROL_TIMEOUT
        )
        timeout = timedelta(seconds=spec.collective_timeout)
        data = dist.new_group(backend=spec.backend, timeout=timeout)
        return cls(Shard.of(data), store, spec, local_rank, local_size)

    def place(self, device: torch.device) -> torch.device:
        """This rank's device: on CUDA the GPU `local_rank` places after `device`; on a
        CPU the same one, with this rank's share of the host's cores for its threads."""
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + self.local_rank)
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.local_size))
        self.device = device
        return device

    # ---- the control group: messages and agreements --------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        """Rank 0: `message` to every follower (each receives it). Bounded by the
        collective timeout, unlike the control group's other calls: gloo's send waits
        for the receiver to be ready, and a follower stopped between two plans would
        hold rank 0 here for the control group's day."""
        data = orjson.dumps(message)
        timeout = timedelta(seconds=self.spec.collective_timeout)
        size = torch.tensor([len(data)], dtype=torch.long)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for tensor in (size, body):
            dist.broadcast(tensor, src=0, async_op=True).wait(timeout=timeout)

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
        errors they reported, and which of those it started exited. A killed follower's
        sockets close before it can be reaped, so rank 0's collective may fail first:
        nothing showing yet, it looks again for up to EXIT_SETTLE_S."""
        deadline = time.monotonic() + EXIT_SETTLE_S
        while not (found := self._failures_now()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return found

    def _failures_now(self) -> str:
        started = dict(enumerate(self.followers, start=1))
        found = []
        for rank in range(1, self.world_size):
            key, process = FAILURE_KEY.format(rank=rank), started.get(rank)
            if self.store.check([key]):
                found.append(f"rank {rank}: {self.store.get(key).decode()}")
            elif process is not None and process.poll() is not None:
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


def follower_command(address: str, rank: int, local_size: int) -> list[str]:
    """A follower rank 0 starts on its own host: it dies with rank 0."""
    return [
        sys.executable,
        "-m",
        "gpu_worker.follower",
        f"--store={address}",
        f"--rank={rank}",
        f"--local-size={local_size}",
        f"--parent={os.getpid()}",
    ]


def _host_port(address: str) -> tuple[str, int]:
    """ "HOST:PORT" -> (HOST, PORT); ValueError, saying so, for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a group's store address is HOST:PORT, not {address!r}")
    return host, int(port)


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
