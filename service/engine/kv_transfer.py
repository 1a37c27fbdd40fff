"""Disaggregated prefill and decode, the service's part: the records of vLLM's two-stage
handover (kv_transfer_params) and the producer's holds.

A producer (--kv-transfer-role producer|both) computes a `do_remote_decode` request's prompt
and, when the request ends, keeps its blocks under a transfer id until the consumer's notice
or the hold's deadline (KvHolds); its answer's kv_transfer_params say where they are. A
consumer (consumer|both) checks that the producer's cache is laid out as its own (the
fingerprint), pulls the blocks (the scheduler's receiving sequences), and computes only the
prompt's last token. The transfer itself is the worker's (gpu_worker.kv_connector).
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gpu_worker.protocol import Handshake, RemoteRank
from service.engine.validation import InvalidRequest

if TYPE_CHECKING:
    from service.engine.request import SamplingParams

ROLE_PRODUCER, ROLE_CONSUMER, ROLE_BOTH = "producer", "consumer", "both"
KV_TRANSFER_ROLES = (ROLE_PRODUCER, ROLE_CONSUMER, ROLE_BOTH)
KV_TRANSFER_FAILED = "kv_transfer_failed"  # a consumer's request whose pull failed ends so
PARAM = "kv_transfer_params"


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
    block_ids: list[int]
    tensors: list[int]  # the producer's cache tensors' base addresses
    num_blocks: int  # the producer's cache's blocks
    prompt_tokens: int
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # at tensor parallel size > 1 every producer rank's (remote_ranks), rank 0's first
    ranks: list[RemoteRank] = field(default_factory=list)

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(slots=True)
class KvHold:
    """A producer's finished request whose blocks wait for the consumer's pull."""

    transfer_id: str
    seq_id: int
    block_ids: list[int]
    prompt_tokens: int
    deadline: float  # engine clock


@dataclass(slots=True)
class KvHolds:
    """The producer's holds by transfer id, and how many ended each way."""

    timeout: float
    by_id: dict[str, KvHold] = field(default_factory=dict)
    held: int = 0
    released: int = 0
    expired: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)

    def hold(self, seq_id: int, block_ids: list[int], prompt_tokens: int, now: float) -> KvHold:
        transfer_id = f"kvx-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        hold = KvHold(transfer_id, seq_id, block_ids, prompt_tokens, now + self.timeout)
        self.by_id[transfer_id] = hold
        self.held += 1
        return hold

    def release(self, transfer_ids: list[str]) -> list[KvHold]:
        """The holds the consumers' notices end (unknown ids: already expired)."""
        ended = [h for t in transfer_ids if (h := self.by_id.pop(t, None)) is not None]
        self.released += len(ended)
        return ended

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
    if len(remote.block_ids) != -(-prompt_len // handshake.block_size):
        raise InvalidRequest(
            f"{len(remote.block_ids)} remote_block_ids do not hold a {prompt_len}-token prompt",
            PARAM,
        )
    _check_remote_ranks(remote, tp_size(handshake))


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
    hold: KvHold, handshake: Handshake, engine_id: str, fingerprint: Fingerprint
) -> dict[str, Any]:
    """The kv_transfer_params of a producer's answer: vLLM's connectors' fields, then
    cadence's own (the router copies them whole into the consumer's request); at tensor
    parallel size > 1 every rank's address and tensors (remote_ranks)."""
    assert handshake.kv_transfer_address is not None  # a producer's worker has an engine
    host, port = _host_port(handshake.kv_transfer_address)
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": hold.block_ids,
        "remote_host": host,
        "remote_port": int(port),
        "transfer_id": hold.transfer_id,
        "prompt_tokens": hold.prompt_tokens,
        "fingerprint": asdict(fingerprint),
        "remote_tensors": handshake.kv_tensor_addresses,
        "remote_num_blocks": handshake.num_blocks,
    }
    if tp_size(handshake) > 1:
        params["remote_ranks"] = [_remote_rank(rank) for rank in handshake.ranks]
    return params


def _remote_rank(rank: dict[str, Any]) -> dict[str, Any]:
    """A remote_ranks entry: where a producer rank (Handshake.ranks) serves its shard."""
    host, port = _host_port(rank["kv_transfer_address"])
    return {"remote_host": host, "remote_port": port, "remote_tensors": rank["kv_tensor_addresses"]}


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
