"""The worker's side of disaggregated prefill and decode: a KV connector moves blocks of one
worker's paged cache into another's, beside the steps and never in their path.

A producer's connector only registers its cache: consumers read from it and notify it as
they begin (a one-byte read that carries the notice: the producer keeps the hold while the
read runs) and when they are done (poll_notices). A consumer's connector pulls (a StepPlan's
KvPulls): each pull becomes segments, a run of consecutive blocks on both sides making one
segment per cache tensor and KV head (the cache is [kv_heads, blocks, block_size, ...]), so
a fresh cache moves a prompt in a few large copies. The copies run on one thread of the
connector's, fed by a bounded queue: the engines' calls release the GIL, so the step goes on
while a transfer runs; poll_done reports the pulls that ended since it was last asked.

A producer with a staging arena (gpu_worker.kv_staging) gathers a held prompt into one
region of it (`stage`); a pull of such a region reads it in one segment into a landing
buffer of the consumer's (registered, grown as larger pulls come: the one thread means one
buffer) and scatters it into the blocks, or, when the consumer's blocks are one run, reads
it straight into them (a segment per cache tensor and KV head, and no copy after).

An implementation gives the transfer itself (`_read`); this module the planning, the
thread and the bookkeeping, which are the same for each.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_staging import block_bytes, gather, is_one_run, scatter
from gpu_worker.protocol import KvPull, KvStage, PullDone

# pulls waiting for the thread: more than a step admits; a full queue fails the pull
MAX_QUEUED_PULLS = 256
# a consumer's notices to the producer, by transfer id: it begins to read, it has read
NOTICE_READING, NOTICE_DONE = "reading", "done"
Notice = tuple[str, str]  # (transfer id, NOTICE_READING or NOTICE_DONE)


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


@dataclass(slots=True)
class Transfer:
    """A pull as the connector's thread runs it: its copies, or None for a staged region
    landed whole (its one segment is planned on the thread, which owns the landing buffer)
    and then scattered into the blocks."""

    pull: KvPull
    segments: Segments | None
    queued: float = field(default_factory=time.monotonic)

    def check_in_time(self) -> None:
        """KvTransferError where the pull waited past its start_within (the hold's end)."""
        waited, allowed = time.monotonic() - self.queued, self.pull.start_within
        if allowed is not None and waited > allowed:
            raise KvTransferError(
                f"the producer's hold ends before this pull could start (it had {allowed:.1f} "
                f"s, and waited {waited:.1f} s for the pulls before it)"
            )


def plan_transfer(pull: KvPull, tensors: list[torch.Tensor]) -> Transfer:
    """How `pull` moves into `tensors` (this worker's cache)."""
    if len(pull.remote_tensors) != len(tensors):
        raise KvTransferError(
            f"the producer lists {len(pull.remote_tensors)} cache tensors, this worker "
            f"{len(tensors)}"
        )
    if pull.remote_staging_address is None:
        return Transfer(pull, plan_segments(pull, tensors))
    if is_one_run(pull.local_blocks):
        return Transfer(pull, direct_segments(pull, tensors))
    return Transfer(pull, None)


def plan_segments(pull: KvPull, tensors: list[torch.Tensor]) -> Segments:
    """The copies that move `pull`'s blocks from the producer's cache into `tensors`."""
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


def direct_segments(pull: KvPull, tensors: list[torch.Tensor]) -> Segments:
    """The copies that read a staged region straight into `pull`'s local blocks, one run:
    a segment per cache tensor and KV head (the region's order, kv_staging)."""
    assert pull.remote_staging_address is not None
    segments, count, remote = Segments(), len(pull.local_blocks), pull.remote_staging_address
    for tensor in tensors:
        size = tensor.element_size()
        block, head = tensor.stride(1) * size, tensor.stride(0) * size
        first = tensor.data_ptr() + pull.local_blocks[0] * block
        for h in range(tensor.shape[0]):
            segments.local.append(first + h * head)
            segments.remote.append(remote)
            segments.lengths.append(count * block)
            remote += count * block
    return segments


def settle(device: torch.device) -> None:
    """Wait for the device's copies: what a peer reads, or a pull reports done, is written."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class KvConnector:
    """Registers a cache, pulls blocks into it off the step's path, reports pulls done and
    the notices of consumers that pulled from it. Subclasses give the transfer."""

    def __init__(self) -> None:
        self.address = ""  # host:port where peers reach this connector
        self._tensors: list[torch.Tensor] = []
        self._arena: torch.Tensor | None = None  # a producer's staging arena (kv_staging)
        self._landing: torch.Tensor | None = None  # where staged regions land (the thread's)
        self._pulls: queue.Queue[Transfer | None] = queue.Queue(MAX_QUEUED_PULLS)
        self._done: list[PullDone] = []
        self._lock = threading.Lock()  # guards _done between the thread and the step
        self._thread: threading.Thread | None = None

    def register(self, cache: KVCache, arena: torch.Tensor | None = None) -> list[int]:
        """Make the cache's tensors, and the staging arena if any, readable by peers;
        returns the tensors' base addresses."""
        self._tensors, self._arena = cache_tensors(cache), arena
        for tensor in [*self._tensors, *([] if arena is None else [arena])]:
            self._register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        return self.addresses

    @property
    def addresses(self) -> list[int]:
        """The registered tensors' base addresses (a KvPull's remote_tensors, to a peer)."""
        return [t.data_ptr() for t in self._tensors]

    @property
    def block_bytes(self) -> int:
        """One block's bytes over every registered cache tensor and KV head."""
        return block_bytes(self._tensors)

    @property
    def staging_address(self) -> int | None:
        return None if self._arena is None else self._arena.data_ptr()

    @property
    def staging_blocks(self) -> int:
        return 0 if self._arena is None else self._arena.numel() // self.block_bytes

    def stage(self, stages: list[KvStage]) -> None:
        """Gather each stage's blocks into its region of the arena, written when this
        returns (a step's, after its forward pass); ValueError where one does not fit."""
        if self._arena is None:
            raise ValueError("the plan stages K/V; this worker has no staging arena")
        for stage in stages:
            gather(self._tensors, self._arena, stage)
        settle(self._arena.device)

    def submit(self, pulls: list[KvPull], rank: int = 0) -> None:
        """Start `pulls` (this rank's part of each, in a tensor-parallel group); each ends
        in a later poll_done, failed or not."""
        for pull in pulls:
            try:
                part = pull.for_rank(rank)
                self._pulls.put_nowait(plan_transfer(part, self._tensors))
            except (KvTransferError, ValueError, queue.Full) as exc:
                self._report(PullDone(pull.transfer_id, error=str(exc) or "too many pulls"))
                continue
            self._ensure_thread()

    def poll_done(self) -> list[PullDone]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def poll_notices(self) -> list[Notice]:
        """The notices of consumers that began to read, or read, from this worker since the
        last call."""
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
        while (transfer := self._pulls.get()) is not None:
            segments, error = transfer.segments, None
            try:
                segments = self._pull(transfer)
            except KvTransferError as exc:
                error = str(exc)
            done = PullDone(transfer.pull.transfer_id, error)
            if segments is not None:
                done.bytes, done.segments = segments.bytes, len(segments.lengths)
            self._report(done)

    def _pull(self, transfer: Transfer) -> Segments:
        """Runs `transfer`, the producer told as the read begins and when it is done;
        returns the copies made. Raises KvTransferError."""
        pull = transfer.pull
        transfer.check_in_time()
        self._read(pull.peer, self._announcement(pull), pull.transfer_id, NOTICE_READING)
        segments = transfer.segments or self._landing_segments(pull)
        self._read(pull.peer, segments, pull.transfer_id, NOTICE_DONE)
        if transfer.segments is None:  # landed: into the blocks now
            assert self._landing is not None
            scatter(self._tensors, self._landing, pull.local_blocks)
            settle(self._landing.device)
        return segments

    def _announcement(self, pull: KvPull) -> Segments:
        """A one-byte read that carries the reading notice (a notice goes only with a read):
        the producer's first cache byte into this cache's scratch block, which only
        padding writes and nothing reads as K/V."""
        first = self._tensors[0]
        scratch = first.data_ptr() + (first.shape[1] - 1) * first.stride(1) * first.element_size()
        return Segments([scratch], [pull.remote_tensors[0]], [1])

    def _landing_segments(self, pull: KvPull) -> Segments:
        """The one copy that lands `pull`'s staged region, the landing buffer grown (and
        registered) to hold it."""
        assert pull.remote_staging_address is not None
        length = len(pull.local_blocks) * self.block_bytes
        if self._landing is None or self._landing.numel() < length:
            if self._landing is not None:
                self._unregister(self._landing.data_ptr())
            self._landing = torch.empty(length, dtype=torch.uint8, device=self._tensors[0].device)
            self._register(self._landing.data_ptr(), length)
        return Segments([self._landing.data_ptr()], [pull.remote_staging_address], [length])

    def _report(self, done: PullDone) -> None:
        with self._lock:
            self._done.append(done)

    def _register(self, address: int, length: int) -> None:
        raise NotImplementedError

    def _unregister(self, address: int) -> None:
        raise NotImplementedError

    def _read(self, peer: str, segments: Segments, transfer_id: str, notice: str) -> None:
        """Copy `segments` from `peer`, then send it `notice` of `transfer_id`; raises
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
