"""The Hypercorn send race (service/server.py, survive_the_send_race): a send that meets a
connection being closed must end that connection, never the server."""

from __future__ import annotations

import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData
from hypercorn.trio.tcp_server import TCPServer

from service.server import survive_the_send_race


class ClosingStream:
    """A socket stream that is sending its EOF: a send now is a BusyResourceError."""

    async def send_all(self, data: bytes) -> None:
        raise trio.BusyResourceError("another task is currently sending data on this SocketStream")


class RecordingProtocol:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def handle(self, event: object) -> None:
        self.events.append(event)


def connection() -> TCPServer:
    server = TCPServer(None, HypercornConfig(), None, None, ClosingStream())  # type: ignore[arg-type]
    server.protocol = RecordingProtocol()  # type: ignore[assignment]
    return server


async def test_hypercorn_alone_lets_the_race_escape():
    """What the fix is for (if hypercorn fixes it, this fails: drop the fix then)."""
    hypercorns = getattr(TCPServer.protocol_send, "__wrapped__", TCPServer.protocol_send)
    with pytest.raises(trio.BusyResourceError):
        await hypercorns(connection(), RawData(b"x"))


async def test_a_send_racing_the_close_ends_only_its_connection():
    survive_the_send_race()
    survive_the_send_race()  # idempotent: wrapped once
    server = connection()
    await server.protocol_send(RawData(b"HTTP/1.1 200 OK\r\n"))
    assert [type(e) for e in server.protocol.events] == [Closed]  # type: ignore[attr-defined]
