"""One HTTP connection's failure ends that connection, never the server
(service/server.py, contain_connection_failures): Hypercorn runs each connection in the
server's own nursery, and sglang-router's HTTP/2 health probe made two of its errors
escape (a send racing the close, a dropped HTTP/2 stream's KeyError)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import RawData
from hypercorn.trio.tcp_server import TCPServer

from service.server import contain_connection_failures, contained


class ClosingStream:
    """A socket stream that is sending its EOF: a send now is a BusyResourceError."""

    async def send_all(self, data: bytes) -> None:
        raise trio.BusyResourceError("another task is currently sending data on this SocketStream")


class RecordingProtocol:
    async def handle(self, event: object) -> None:
        pass


async def test_hypercorn_lets_a_send_racing_the_close_escape():
    """What the containment is for (if hypercorn fixes it, this fails: look again then)."""
    server = TCPServer(None, HypercornConfig(), None, None, ClosingStream())  # type: ignore[arg-type]
    server.protocol = RecordingProtocol()  # type: ignore[assignment]
    with pytest.raises(trio.BusyResourceError):
        await server.protocol_send(RawData(b"HTTP/1.1 200 OK\r\n"))


@pytest.mark.parametrize(
    "failure",
    [trio.BusyResourceError("sending"), KeyError(1), ExceptionGroup("nursery", [KeyError(1)])],
)
async def test_a_connection_that_fails_is_logged_and_ends_alone(failure: Exception):
    async def run(connection: object) -> None:
        raise failure

    with structlog.testing.capture_logs() as logs:
        await contained(run)(SimpleNamespace(stream=None))  # type: ignore[arg-type]
    assert [(e["event"], e["log_level"]) for e in logs] == [("http.connection_failed", "warning")]
    assert logs[0]["error"] == repr(failure)


async def test_cancellation_still_reaches_the_connection():
    async def run(connection: object) -> None:
        await trio.sleep_forever()

    with trio.move_on_after(0.01) as scope:
        await contained(run)(SimpleNamespace(stream=None))  # type: ignore[arg-type]
    assert scope.cancelled_caught


def test_the_server_installs_it_once():
    contain_connection_failures()
    installed = TCPServer.run
    contain_connection_failures()
    assert TCPServer.run is installed and hasattr(installed, "__wrapped__")
