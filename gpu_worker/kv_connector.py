"""The worker's side of disaggregated prefill and decode: a KV connector moves blocks of
one worker's paged cache into another's, beside the steps and never in their path.

A producer's connector only registers its cache: consumers read from it and notify it when
they are done (poll_notices). A consumer's connector pulls (a StepPlan's KvPulls): each
pull becomes segments, a run of consecutive blocks on both sides making one segment per
cache tensor and KV head (the cache is [kv_heads, blocks, block_size, ...]), so a fresh
cache moves a prompt in a few large copies. The copies run on one thread of the
connector's, fed by a bounded queue: the engines' calls release the GIL, so the step goes
on while a transfer runs; poll_done reports the pulls that ended since it was last asked.

An implementation gives the transfer itself (`_read`); this module the planning, the
thread and the bookkeeping, which are the same for each.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from gpu_worker.kv_cache import KVCache
from gpu_worker.protocol import KvPull, PullDone

# pulls waiting for the thread: more than a step admits; a full queue fails the pull
MAX_QUEUED_PULLS = 256


class KvTransferError(RuntimeError):
    """A transfer engine refused to start or to copy."""


@dataclass(slots=True)
class Segments:
    """One pull's copies: local address, remote address and length, in parallel lists."""

    local: list[int] = field(default_factory=list)
    remote: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(self.lengths)


def cache_tensors(cache: KVCache) -> list[torch.Tensor]:
    """The tensors a connector registers and pulls, in the order both sides list them."""
    return [t for slot in cache.slots for t in slot.tensors if t is not None]


def block_runs(local: list[int], remote: list[int]) -> Iterator[tuple[int, int, int]]:
    """(first local block, first remote block, count) for each run of blocks consecutive
    on both sides."""
    start = 0
    for i in range(1, len(local) + 1):
        ends = i == len(local) or local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1
        if ends:
            yield local[start], remote[start], i - start
            start = i


def plan_segments(pull: KvPull, tensors: list[torch.Tensor]) -> Segments:
    """The copies that move `pull`'s blocks into `tensors` (this worker's cache)."""
    if len(pull.remote_tensors) != len(tensors):
        raise KvTransferError(
            f"the producer lists {len(pull.remote_tensors)} cache tensors, this worker "
            f"{len(tensors)}"
        )
    segments = Segments()
    runs = list(block_runs(pull.local_blocks, pull.remote_blocks))
    for tensor, remote_base in zip(tensors, pull.remote_tensors, strict=True):
        size = tensor.element_size()
        block_bytes, local_head = tensor.stride(1) * size, tensor.stride(0) * size
        remote_head = (pull.remote_num_blocks + 1) * block_bytes  # its scratch block too
        for head in range(tensor.shape[0]):
            for local, remote, count in runs:
                segments.local.append(tensor.data_ptr() + head * local_head + local * block_bytes)
                segments.remote.append(remote_base + head * remote_head + remote * block_bytes)
                segments.lengths.append(count * block_bytes)
    return segments


class KvConnector:
    """Registers a cache, pulls blocks into it off the step's path, reports pulls done and
    the notices of consumers that pulled from it. Subclasses give the transfer."""

    def __init__(self) -> None:
        self.address = ""  # host:port where peers reach this connector
        self._tensors: list[torch.Tensor] = []
        self._pulls: queue.Queue[tuple[KvPull, Segments] | None] = queue.Queue(MAX_QUEUED_PULLS)
        self._done: list[PullDone] = []
        self._lock = threading.Lock()  # guards _done between the thread and the step
        self._thread: threading.Thread | None = None

    def register(self, cache: KVCache) -> list[int]:
        """Make the cache's tensors readable by peers; returns their base addresses."""
        self._tensors = cache_tensors(cache)
        for tensor in self._tensors:
            self._register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        return self.addresses

    @property
    def addresses(self) -> list[int]:
        """The registered tensors' base addresses (a KvPull's remote_tensors, to a peer)."""
        return [t.data_ptr() for t in self._tensors]

    def submit(self, pulls: list[KvPull], rank: int = 0) -> None:
        """Start `pulls` (this rank's part of each, in a tensor-parallel group); each ends
        in a later poll_done, failed or not."""
        for pull in pulls:
            try:
                part = pull.for_rank(rank)
                self._pulls.put_nowait((part, plan_segments(part, self._tensors)))
            except (KvTransferError, ValueError, queue.Full) as exc:
                self._report(PullDone(pull.transfer_id, error=str(exc) or "too many pulls"))
                continue
            self._ensure_thread()

    def poll_done(self) -> list[PullDone]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def poll_notices(self) -> list[str]:
        """Transfer ids consumers have pulled from this worker since the last call."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the thread after the pulls queued (the worker exits next)."""
        if self._thread is not None:
            self._pulls.put(None)
            self._thread.join()
            self._thread = None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="kv-pulls", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while (item := self._pulls.get()) is not None:
            pull, segments = item
            error = None
            try:
                self._read(pull.peer, segments, pull.transfer_id)
            except KvTransferError as exc:
                error = str(exc)
            self._report(PullDone(pull.transfer_id, error, segments.bytes, len(segments.lengths)))

    def _report(self, done: PullDone) -> None:
        with self._lock:
            self._done.append(done)

    def _register(self, address: int, length: int) -> None:
        raise NotImplementedError

    def _read(self, peer: str, segments: Segments, transfer_id: str) -> None:
        """Copy `segments` from `peer`, then notify it of `transfer_id`; raises
        KvTransferError. Runs on the connector's thread."""
        raise NotImplementedError


def make_connector(engine: str, host: str, timeout: float = 30.0) -> KvConnector:
    """The connector of WorkerConfig.kv_transfer_engine; `timeout`: a pull's seconds."""
    from gpu_worker.protocol import KV_ENGINE_LOCAL, KV_ENGINE_MOONCAKE

    if engine == KV_ENGINE_MOONCAKE:
        from gpu_worker.kv_connector_mooncake import MooncakeConnector

        return MooncakeConnector(host, timeout)
    if engine == KV_ENGINE_LOCAL:
        from gpu_worker.kv_connector_local import LocalConnector

        return LocalConnector()
    raise ValueError(f"kv_transfer_engine must be mooncake or local, not {engine!r}")
