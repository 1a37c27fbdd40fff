"""Disaggregated prefill and decode, the service's part: the records of vLLM's two-stage
handover (kv_transfer_params) and the producer's holds.

A producer (--kv-transfer-role producer|both) computes a `do_remote_decode` request's prompt
and, when the request ends, keeps its blocks under a transfer id until the consumer's notice
or the hold's deadline (KvHolds); its answer's kv_transfer_params say where they are. A
consumer (consumer|both) checks that the producer's cache is laid out as its own (the
fingerprint), pulls the blocks (the scheduler's receiving sequences), and computes only the
prompt's last token. The transfer itself is the worker's (gpu_worker.kv_connector).

A producer with a staging arena (--kv-staging-tokens, gpu_worker.kv_staging) has the step
that ends a do_remote_decode request gather its prompt into one region of it, so a consumer
reads it in one segment however fragmented the caches are; StagingArena places the regions.
A prompt that finds no room is held unstaged and pulled from the cache as before.

A hold outlives the pull that reads it: the consumer's connector notifies the producer as
its read begins, which keeps the hold for --kv-transfer-timeout more (the read fails by
then), and the producer's answer says how long its hold has left (remote_hold_seconds),
so a consumer never starts a read later than HOLD_MARGIN_S before the hold ends: such a
pull fails kv_transfer_failed unread (vLLM's rule: fail, never read freed blocks).

KV groups (a hybrid model's, BlockManager): the blocks are listed per group, as vLLM's
hybrid connectors do (`remote_block_ids` a list per group; one group's a flat list, as
before). A full group hands over all the prompt's blocks; a windowed group only those its
window reads from the handover's position (`handover_position`) on: the ones behind it the
producer may have given to someone else already, and the consumer never reads them.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gpu_worker.protocol import Handshake, RemoteRank
from service.engine.block_manager import first_entry_read
from service.engine.validation import InvalidRequest

if TYPE_CHECKING:
    from service.engine.request import SamplingParams

ROLE_PRODUCER, ROLE_CONSUMER, ROLE_BOTH = "producer", "consumer", "both"
KV_TRANSFER_ROLES = (ROLE_PRODUCER, ROLE_CONSUMER, ROLE_BOTH)
KV_TRANSFER_FAILED = "kv_transfer_failed"  # a consumer's request whose pull failed ends so
PARAM = "kv_transfer_params"
# A consumer's read starts at least this long before the producer's hold ends: its reading
# notice must reach the producer's engine (after a step of the producer's) before the hold
# expires there.
HOLD_MARGIN_S = 1.0


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What two caches must share for one's blocks to be the other's K/V."""

    model: str
    dtype: str
    cache_dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    kv_groups: int
    tp_size: int

    @classmethod
    def of(cls, handshake: Handshake) -> Fingerprint:
        return cls(
            handshake.model_name,
            handshake.dtype,
            handshake.kv_cache_dtype,
            handshake.num_layers,
            handshake.num_kv_heads,
            handshake.head_dim,
            handshake.block_size,
            len(handshake.kv_group_windows),
            tp_size(handshake),
        )

    def check(self, theirs: dict[str, Any]) -> None:
        """InvalidRequest naming the first field where `theirs` (a producer's) differs."""
        for name, mine in asdict(self).items():
            if theirs.get(name) != mine:
                raise InvalidRequest(
                    f"the producer's KV cache differs from this server's in {name}: "
                    f"{theirs.get(name)!r} there, {mine!r} here",
                    PARAM,
                    "kv_layout_mismatch",
                )


@dataclass(slots=True)
class RemoteKv:
    """A consumer's request: the producer holds its prompt's K/V (kv_transfer_params with
    do_remote_prefill, as the producer answered them)."""

    transfer_id: str
    engine_id: str
    host: str
    port: int
    block_ids: list[list[int]]  # per KV group
    tensors: list[int]  # the producer's cache tensors' base addresses
    num_blocks: int  # the producer's cache's blocks
    prompt_tokens: int
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # at tensor parallel size > 1 every producer rank's (remote_ranks), rank 0's first
    ranks: list[RemoteRank] = field(default_factory=list)
    staging_address: int | None = None  # where the producer staged it (None: unstaged)
    hold_seconds: float | None = None  # the producer's hold's time left as it answered

    def start_within(self, received: float, now: float) -> float | None:
        """Seconds from `now` within which a read must start (None: no limit said)."""
        if self.hold_seconds is None:
            return None
        return received + self.hold_seconds - HOLD_MARGIN_S - now

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(slots=True)
class KvHold:
    """A producer's finished request whose blocks wait for the consumer's pull."""

    transfer_id: str
    seq_id: int
    block_ids: list[list[int]]  # per KV group
    prompt_tokens: int
    deadline: float  # engine clock
    staged_at: int | None = None  # its region's first block in the staging arena


@dataclass(slots=True)
class KvHolds:
    """The producer's holds by transfer id, and how many ended each way."""

    timeout: float
    read_timeout: float = 30.0  # how long a reading notice keeps its hold (a pull's limit)
    by_id: dict[str, KvHold] = field(default_factory=dict)
    held: int = 0
    released: int = 0
    expired: int = 0
    kept: int = 0  # reading notices that kept their holds
    _ids: itertools.count = field(default_factory=itertools.count)

    def hold(
        self,
        seq_id: int,
        block_ids: list[list[int]],
        prompt_tokens: int,
        now: float,
        staged_at: int | None = None,
    ) -> KvHold:
        transfer_id = f"kvx-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        deadline = now + self.timeout
        hold = KvHold(transfer_id, seq_id, block_ids, prompt_tokens, deadline, staged_at)
        self.by_id[transfer_id] = hold
        self.held += 1
        return hold

    def release(self, transfer_ids: list[str]) -> list[KvHold]:
        """The holds the consumers' notices end (unknown ids: already expired)."""
        ended = [h for t in transfer_ids if (h := self.by_id.pop(t, None)) is not None]
        self.released += len(ended)
        return ended

    def keep_reading(self, transfer_ids: list[str], now: float) -> None:
        """Consumers began to read these: their holds last while a read may (unknown ids:
        already ended)."""
        for hold in (h for t in transfer_ids if (h := self.by_id.get(t)) is not None):
            hold.deadline = max(hold.deadline, now + self.read_timeout)
            self.kept += 1

    def expire(self, now: float) -> list[KvHold]:
        ended = [h for h in self.by_id.values() if h.deadline <= now]
        for hold in ended:
            del self.by_id[hold.transfer_id]
        self.expired += len(ended)
        return ended

    @property
    def seq_ids(self) -> set[int]:
        return {h.seq_id for h in self.by_id.values()}

    def state(self) -> dict[str, int]:
        return {
            "holding": len(self.by_id),
            "held": self.held,
            "released": self.released,
            "expired": self.expired,
        }


@dataclass(slots=True)
class StagingArena:
    """Where in the producer worker's staging arena each prompt's region lies, by sequence:
    taken in the step that ends the request (first fit; no room: the prompt goes unstaged),
    kept by its hold, freed with it, or when the request ends otherwise."""

    blocks: int = 0  # the worker's arena (Handshake.kv_staging_blocks)
    regions: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq -> (first, count)
    staged: int = 0
    unstaged: int = 0  # prompts that found no room

    def take(self, seq_id: int, count: int) -> int | None:
        """The first block of a free region of `count` blocks, now `seq_id`'s; None: none."""
        start = 0
        for first, taken in sorted(self.regions.values()):
            if first - start >= count:
                break
            start = first + taken
        if start + count > self.blocks:
            self.unstaged += 1
            return None
        self.regions[seq_id] = (start, count)
        self.staged += 1
        return start

    def first_block(self, seq_id: int) -> int | None:
        region = self.regions.get(seq_id)
        return None if region is None else region[0]

    def free(self, seq_id: int) -> None:
        self.regions.pop(seq_id, None)

    def reset(self, blocks: int) -> None:
        """A new worker's arena: the old one's regions went with it."""
        self.blocks = blocks
        self.regions.clear()

    @property
    def used(self) -> int:
        return sum(count for _, count in self.regions.values())

    def check_invariants(self, owners: set[int]) -> None:
        """Regions lie inside the arena, apart, each of a sequence in `owners`."""
        end = 0
        for first, count in sorted(self.regions.values()):
            assert first >= end and count > 0, "staging regions overlap"
            end = first + count
        assert end <= self.blocks, "a staging region past the arena"
        assert set(self.regions) <= owners, "a staging region outlived its sequence"

    def state(self) -> dict[str, int]:
        return {
            "blocks": self.blocks,
            "used": self.used,
            "staged": self.staged,
            "unstaged": self.unstaged,
        }


def handover_position(prompt_len: int, block_size: int) -> int:
    """The first position the handed-over K/V serves: the consumer computes the prompt's
    last token, but a later prompt sharing its cached blocks computes from their end, so
    a windowed group hands over that position's window (at most one block more): the
    consumer's prefix cache then holds every block such a hit reads."""
    return (prompt_len - 1) // block_size * block_size


def handover_counts(prompt_len: int, block_size: int, windows: Sequence[int | None]) -> list[int]:
    """How many blocks of each KV group a `prompt_len`-token prompt's handover moves."""
    entries = -(-prompt_len // block_size)
    position = handover_position(prompt_len, block_size)
    return [entries - first_entry_read(w, block_size, position) for w in windows]


def check_kv_transfer(
    params: SamplingParams, prompt_len: int, n: int, role: str | None, handshake: Handshake
) -> None:
    """InvalidRequest unless this server's role serves the request's part of a handover, and
    a consumer's request matches the producer's cache and prompt."""
    if not (params.remote_decode or params.remote_kv):
        return
    wanted = ROLE_PRODUCER if params.remote_decode else ROLE_CONSUMER
    if role not in (wanted, ROLE_BOTH):
        raise InvalidRequest(
            f"this server is not a KV {wanted} (cadence serve --kv-transfer-role "
            f"{wanted}); send it requests without {PARAM}",
            PARAM,
        )
    if n != 1:
        raise InvalidRequest(f"a request with {PARAM} has one sequence (n 1)", "n")
    remote = params.remote_kv
    if remote is None:
        return
    Fingerprint.of(handshake).check(remote.fingerprint)
    if remote.prompt_tokens != prompt_len:
        raise InvalidRequest(
            f"the producer computed {remote.prompt_tokens} prompt tokens, this server's "
            f"prompt has {prompt_len}: send the prefill and the decode server the same request",
            PARAM,
        )
    _check_block_counts(remote.block_ids, prompt_len, handshake)
    _check_remote_ranks(remote, tp_size(handshake))


def _check_block_counts(block_ids: list[list[int]], prompt_len: int, handshake: Handshake) -> None:
    """InvalidRequest unless the remote blocks are those a handover of a `prompt_len`-token
    prompt lists for each of this cache's KV groups."""
    wanted = handover_counts(prompt_len, handshake.block_size, handshake.kv_group_windows)
    if len(block_ids) != len(wanted):
        raise InvalidRequest(
            f"remote_block_ids lists {len(block_ids)} KV groups' blocks, this model has "
            f"{len(wanted)} (a list of block ids per group)",
            PARAM,
        )
    for group, (ids, count) in enumerate(zip(block_ids, wanted, strict=True)):
        if len(ids) != count:
            where = "" if len(wanted) == 1 else f" of KV group {group}"
            raise InvalidRequest(
                f"{len(ids)} remote_block_ids{where} do not hold a {prompt_len}-token prompt "
                f"({count} expected)",
                PARAM,
            )


def tp_size(handshake: Handshake) -> int:
    """The worker group's ranks (one without tensor parallelism)."""
    return max(1, len(handshake.ranks))


def _check_remote_ranks(remote: RemoteKv, tp: int) -> None:
    """InvalidRequest unless the producer lists a rank for each of this server's (its rank r
    serves this one's rank r its shard), or none at tensor parallel size 1."""
    wanted = tp if tp > 1 else 0
    if len(remote.ranks) != wanted:
        raise InvalidRequest(
            f"'{PARAM}.remote_ranks' lists {len(remote.ranks)} producer ranks; this server, at "
            f"tensor parallel size {tp}, pulls from {wanted} (as the producer answered them)",
            PARAM,
        )


def producer_params(
    hold: KvHold, handshake: Handshake, engine_id: str, fingerprint: Fingerprint, now: float
) -> dict[str, Any]:
    """The kv_transfer_params of a producer's answer: vLLM's connectors' fields, then
    cadence's own (the router copies them whole into the consumer's request); at tensor
    parallel size > 1 every rank's address and tensors (remote_ranks)."""
    assert handshake.kv_transfer_address is not None  # a producer's worker has an engine
    host, port = _host_port(handshake.kv_transfer_address)
    block_ids = hold.block_ids[0] if len(hold.block_ids) == 1 else hold.block_ids
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_ids,
        "remote_host": host,
        "remote_port": int(port),
        "transfer_id": hold.transfer_id,
        "prompt_tokens": hold.prompt_tokens,
        "fingerprint": asdict(fingerprint),
        "remote_tensors": handshake.kv_tensor_addresses,
        "remote_num_blocks": handshake.num_blocks,
        "remote_staging_address": _staged(hold, handshake.kv_staging_address, handshake),
        "remote_hold_seconds": round(max(0.0, hold.deadline - now), 3),
    }
    if tp_size(handshake) > 1:
        params["remote_ranks"] = [_remote_rank(rank, hold, handshake) for rank in handshake.ranks]
    return params


def _staged(hold: KvHold, arena: int | None, handshake: Handshake) -> int | None:
    """Where a rank's arena holds the hold's gathered region (every rank's shard has the
    same block bytes and the same offsets); None where it is not staged."""
    if hold.staged_at is None or arena is None:
        return None
    return arena + hold.staged_at * handshake.kv_block_bytes


def _remote_rank(rank: dict[str, Any], hold: KvHold, handshake: Handshake) -> dict[str, Any]:
    """A remote_ranks entry: where a producer rank (Handshake.ranks) serves its shard."""
    host, port = _host_port(rank["kv_transfer_address"])
    return {
        "remote_host": host,
        "remote_port": port,
        "remote_tensors": rank["kv_tensor_addresses"],
        "remote_staging_address": _staged(hold, rank.get("kv_staging_address"), handshake),
    }


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
