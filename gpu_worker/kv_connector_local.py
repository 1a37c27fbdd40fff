"""An in-process KV connector, for unit tests only: peers are connectors of the same
process, found by address, and a pull is a memmove of each segment."""

from __future__ import annotations

import ctypes
import itertools
import threading

from gpu_worker.kv_connector import KvConnector, KvTransferError, Notice, Segments

_peers: dict[str, LocalConnector] = {}
_addresses = itertools.count()


class LocalConnector(KvConnector):
    def __init__(self) -> None:
        super().__init__()
        self.address = f"local:{next(_addresses)}"
        self._notices: list[Notice] = []
        self._notice_lock = threading.Lock()
        _peers[self.address] = self

    def _register(self, address: int, length: int) -> None:
        pass  # its memory is this process's

    def _unregister(self, address: int) -> None:
        pass

    def _read(self, peer: str, segments: Segments, transfer_id: str, notice: str) -> None:
        producer = _peers.get(peer)
        if producer is None:
            raise KvTransferError(f"no peer at {peer}")
        for local, remote, length in zip(
            segments.local, segments.remote, segments.lengths, strict=True
        ):
            ctypes.memmove(local, remote, length)
        with producer._notice_lock:
            producer._notices.append((transfer_id, notice))

    def poll_notices(self) -> list[Notice]:
        with self._notice_lock:
            notices, self._notices = self._notices, []
        return notices

    def close(self) -> None:
        super().close()
        _peers.pop(self.address, None)
