"""A KV connector on Mooncake's transfer engine (PyPI mooncake-transfer-engine-non-cuda on
CPU hosts), over TCP with peer-to-peer handshakes: no metadata server. Its synchronous
batch read releases the GIL and carries the notify that tells the producer it is done."""

from __future__ import annotations

from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_connector import KvConnector, KvTransferError, Segments

NOTIFY_DONE = "done"  # the notify's message; its name is the transfer id


class MooncakeConnector(KvConnector):
    def __init__(self, host: str) -> None:
        super().__init__()
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

    def register(self, cache: KVCache) -> list[int]:
        from mooncake import engine

        if cache.like.device.type != "cpu" and not engine.SUPPORT_CUDA:
            raise KvTransferError(
                "this Mooncake build moves host memory only (mooncake-transfer-engine-non-cuda); "
                "a cache on the GPU needs its CUDA build"
            )
        return super().register(cache)

    def _register(self, address: int, length: int) -> None:
        if self._engine.register_memory(address, length) != 0:
            raise KvTransferError(f"mooncake did not register {length} bytes at {address:#x}")

    def _read(self, peer: str, segments: Segments, transfer_id: str) -> None:
        from mooncake.engine import TransferNotify, TransferOpcode

        status = self._engine.batch_transfer_sync(
            peer,
            segments.local,
            segments.remote,
            segments.lengths,
            TransferOpcode.Read,
            TransferNotify(transfer_id, NOTIFY_DONE),
        )
        if status != 0:
            raise KvTransferError(f"mooncake's read from {peer} failed ({status})")

    def poll_notices(self) -> list[str]:
        return [n.name for n in self._engine.get_notifies() if n.msg == NOTIFY_DONE]
