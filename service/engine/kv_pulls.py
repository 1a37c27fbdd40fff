"""A consumer's requests whose prompt K/V comes from a producer (disaggregated prefill and
decode, service.engine.kv_transfer), from arrival until they run: waiting for blocks to pull
into (arrival order), pulling (by transfer id), then pulled and waiting for a running slot.
No policy sees them meanwhile: none is ever scheduled for compute before its K/V is in.

The scheduler decides when each moves on; this keeps the lists, and the rule that a pull
writes its blocks until the worker reports it done: a request that ends mid-pull leaves its
blocks here until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpu_worker.protocol import KvPull
from service.engine.block_manager import BlockManager
from service.engine.kv_transfer import RemoteKv, handover_position
from service.engine.prefix_cache import prefix_hit
from service.engine.request import Request, Status


@dataclass(slots=True)
class KvPulls:
    waiting: list[Request] = field(default_factory=list)
    pulling: dict[str, Request] = field(default_factory=dict)  # by transfer id
    pulled: list[Request] = field(default_factory=list)
    _started: dict[str, float] = field(default_factory=dict)  # engine clock, by transfer id

    @property
    def pending(self) -> bool:
        return bool(self.waiting or self.pulling or self.pulled)

    @property
    def queued(self) -> int:
        """Requests waiting to start: for blocks to pull into, or pulled and waiting for a
        running slot. They count against --max-queue as any waiting request does: else a
        consumer's queue would grow without bound behind a full cache."""
        return len(self.waiting) + len(self.pulled)

    def start(self, blocks: BlockManager, now: float) -> list[KvPull]:
        """Blocks for the waiting requests' prompts, in arrival order while they fit
        (beside the watermark kept for running ones to grow), each with its pull."""
        pulls = []
        while self.waiting:
            request = self.waiting[0]
            remote = request.params.remote_kv
            assert remote is not None  # only such requests are here
            room = blocks.num_available - blocks.watermark_blocks
            if blocks.blocks_to_hold(request.prompt_len) > room:
                break
            self.waiting.pop(0)
            request.status = Status.RECEIVING
            self.pulling[remote.transfer_id] = request
            self._started[remote.transfer_id] = now
            pulls.append(_pull(blocks, request, remote, now))
        return pulls

    def finish(self, transfer_id: str) -> Request | None:
        """The request whose pull the worker reports done (None: unknown, or forgotten)."""
        self._started.pop(transfer_id, None)
        return self.pulling.pop(transfer_id, None)

    def leave(self, request: Request) -> bool:
        """`request` ended: whether its blocks may be freed now (not while pulled into)."""
        for queue in (self.waiting, self.pulled):
            if request in queue:
                queue.remove(request)
                return True
        return not any(r is request for r in self.pulling.values())

    def overdue(self, now: float, timeout: float) -> list[Request]:
        """Pulling requests whose pull began `timeout` s ago or more (ended ones too)."""
        return [
            request
            for transfer_id, request in self.pulling.items()
            if now - self._started[transfer_id] >= timeout
        ]

    def ended_mid_pull(self, live: set[int] | dict[int, Request]) -> set[int]:
        """The sequences (not in `live`) whose blocks a pull still writes."""
        return {r.seq_id for r in self.pulling.values() if r.seq_id not in live}

    def forget_pulls(self) -> None:
        """A new worker: the old one's pulls will never be reported."""
        self.pulling.clear()
        self._started.clear()


def _pull(blocks: BlockManager, request: Request, remote: RemoteKv, now: float) -> KvPull:
    """Blocks for `request`'s prompt, from its cached prefix on, a windowed group's only
    from the handover's window on (kv_transfer.handover_position), and the pull of the
    rest of every group's blocks into them: its (remote, local) pairs, group after group
    (a block id names one slot in every cache tensor, whichever group holds it). The
    producer lists each group's blocks to the prompt's end, so they align at the end.
    A staged region holds all the listed blocks, group after group: a pull of part of them
    (after a hit here) reads the producer's cache instead."""
    position = handover_position(request.prompt_len, blocks.block_size)
    hit = prefix_hit(blocks, request)
    blocks.allocate_reading(request.seq_id, request.prompt_len, position, hit)
    request.num_cached_tokens = hit.num_blocks * blocks.block_size
    local = blocks.reading_tables(request.seq_id, request.prompt_len, position, hit.num_blocks)
    pairs = [
        (theirs[len(theirs) - len(mine) :], mine)
        for theirs, mine in zip(remote.block_ids, local, strict=True)
    ]
    whole = sum(map(len, local)) == sum(map(len, remote.block_ids))  # no block cached here
    ranks = remote.ranks if whole else [replace(r, staging_address=None) for r in remote.ranks]
    return KvPull(
        remote.transfer_id,
        remote.peer,
        [block for theirs, _ in pairs for block in theirs],
        [block for _, mine in pairs for block in mine],
        remote.tensors,
        remote.num_blocks,
        remote_staging_address=remote.staging_address if whole else None,
        start_within=remote.start_within(request.received, now),
        ranks=ranks,
    )
