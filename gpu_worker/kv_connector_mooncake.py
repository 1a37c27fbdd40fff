"""A KV connector on Mooncake's transfer engine (PyPI mooncake-transfer-engine-non-cuda on
CPU hosts), over TCP with peer-to-peer handshakes: no metadata server. Its synchronous
batch read releases the GIL and carries the notify that tells the producer it is done."""

from __future__ import annotations

import math
import os

import torch

from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_connector import (
    NOTICE_DONE,
    NOTICE_READING,
    KvConnector,
    KvTransferError,
    Notice,
    Segments,
)

# Its TCP transport queues 2,048 tasks: a batch of more segments fails whole (-1), and a
# fragmented cache's pull has a segment per block, cache tensor and KV head (SmolLM2's
# 180 a block), so a pull goes in batches of at most this many
MAX_BATCH_SEGMENTS = 1024


class MooncakeConnector(KvConnector):
    def __init__(self, host: str, timeout: float = 30.0) -> None:
        super().__init__()
        # A peer that hangs (stopped, or its host gone) holds a read until the engine's own
        # timeout, 30 s unless MC_TRANSFER_TIMEOUT says otherwise (read as an engine starts;
        # 5 s at least): meanwhile the blocks stay written to and later pulls wait behind it.
        # (A first contact with a hung peer waits out the handshake's 60 s regardless.)
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(timeout)))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise KvTransferError(
                "the mooncake transfer engine is not installed: pip install 'cadence[pd]' "
                "(and Debian's libibverbs1)"
            ) from exc
        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise KvTransferError(f"the mooncake transfer engine did not start on {host}")
        self.address = f"{host}:{self._engine.get_rpc_port()}"

    def register(self, cache: KVCache, arena: torch.Tensor | None = None) -> list[int]:
        from mooncake import engine

        if cache.like.device.type != "cpu" and not engine.SUPPORT_CUDA:
            raise KvTransferError(
                "this Mooncake build moves host memory only (mooncake-transfer-engine-non-cuda); "
                "a cache on the GPU needs its CUDA build"
            )
        return super().register(cache, arena)

    def _register(self, address: int, length: int) -> None:
        if self._engine.register_memory(address, length) != 0:
            raise KvTransferError(f"mooncake did not register {length} bytes at {address:#x}")

    def _unregister(self, address: int) -> None:
        if self._engine.unregister_memory(address) != 0:
            raise KvTransferError(f"mooncake did not unregister the memory at {address:#x}")

    def _read(self, peer: str, segments: Segments, transfer_id: str, notice: str) -> None:
        """In batches of MAX_BATCH_SEGMENTS; the last one carries the notify (its name the
        transfer id, its message the notice)."""
        from mooncake.engine import TransferNotify, TransferOpcode

        count = len(segments.lengths)
        for start in range(0, max(count, 1), MAX_BATCH_SEGMENTS):
            end = start + MAX_BATCH_SEGMENTS
            status = self._engine.batch_transfer_sync(
                peer,
                segments.local[start:end],
                segments.remote[start:end],
                segments.lengths[start:end],
                TransferOpcode.Read,
                TransferNotify(transfer_id, notice) if end >= count else None,
            )
            if status != 0:
                raise KvTransferError(f"mooncake's read from {peer} failed ({status})")

    def poll_notices(self) -> list[Notice]:
        notices = self._engine.get_notifies()
        return [(n.name, n.msg) for n in notices if n.msg in (NOTICE_READING, NOTICE_DONE)]
