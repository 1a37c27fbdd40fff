"""Open client connections, how many there may be, and which one gives way at the cap.

Each connection holds a descriptor; past the cap (--max-connections) they would run out,
and a worker restart needs two. Refusing the newcomer at the cap let a client that hoards
idle sockets (5,000 sending a request head and no body) lock every other client out,
/health included. So at the cap the connections that have stalled longest without asking
for anything the server is answering are closed to make room (a sixteenth of the cap at
once): ones idle between requests, or still sending a request head or body (slow ones run
out their timeouts anyway). A connection whose request is complete (a stream or a whole
answer in flight) is never closed; only when every connection is such is the newcomer
refused with a 503. A body that stalls past --body-timeout is answered 408 by the app,
and its connection closed here (close_stalled_bodies).
"""

from __future__ import annotations

import contextlib
import heapq
from dataclasses import dataclass, field
from typing import Any

import h11
import orjson
import structlog
import trio

from service.api.errors import error_body

log = structlog.get_logger("cadence.server")
OVER_CAP_BODY = orjson.dumps(
    error_body("too many connections are open; retry later", 503, code="too_many_connections")
)
OVER_CAP_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(OVER_CAP_BODY), OVER_CAP_BODY)
)
# h11 states of a connection that asks for nothing being answered: idle between requests,
# or still receiving its request (head or body), no response begun or one sent whole
WAITING_ON_CLIENT = frozenset({h11.IDLE, h11.SEND_BODY})
NOT_ANSWERING = frozenset({h11.IDLE, h11.SEND_RESPONSE, h11.DONE, h11.MUST_CLOSE})
# At the cap, this fraction of it is closed at once (the longest stalled): finding them is a
# pass over every connection, which a flood of newcomers must not make once each.
EVICTED_AT_ONCE = 16
SWEEP_EVERY_S = 0.5  # how often stalled bodies are looked for


@dataclass(eq=False, slots=True)
class Connection:
    """One client connection: its Hypercorn server and when it last sent the server bytes."""

    server: Any  # hypercorn.trio.tcp_server.TCPServer
    last_read: float = field(default_factory=trio.current_time)

    def may_give_way(self) -> bool:
        """Nothing of it is being answered (an HTTP/2 connection never gives way)."""
        protocol = getattr(getattr(self.server, "protocol", None), "protocol", None)
        connection = getattr(protocol, "connection", None)
        if not isinstance(connection, h11.Connection):
            return protocol is None  # accepted, not yet reading: nothing asked
        return connection.their_state in WAITING_ON_CLIENT and connection.our_state in NOT_ANSWERING

    def stalled_in_body(self, now: float, after: float) -> bool:
        """Its request body has not moved for `after` seconds, and nothing is being sent."""
        protocol = getattr(getattr(self.server, "protocol", None), "protocol", None)
        connection = getattr(protocol, "connection", None)
        return (
            isinstance(connection, h11.Connection)
            and connection.their_state is h11.SEND_BODY
            and connection.our_state is not h11.SEND_BODY
            and now - self.last_read > after
        )

    async def close(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.server.stream.aclose()


class WatchedStream:
    """A connection's stream that notes when bytes arrive (Hypercorn reads through it)."""

    def __init__(self, stream: trio.abc.Stream, connection: Connection) -> None:
        self._stream = stream
        self._connection = connection

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._stream.receive_some(max_bytes)
        self._connection.last_read = trio.current_time()
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Connections:
    """The open connections (one trio run: Hypercorn's serving loop)."""

    limit: int | None = None
    open: set[Connection] = set()

    @classmethod
    async def admit(cls, server: Any) -> Connection | None:
        """The new connection's record, room made for it; None: refused (503, closed)."""
        if cls.limit is not None and len(cls.open) >= cls.limit:
            victims = cls.longest_stalled(max(1, cls.limit // EVICTED_AT_ONCE))
            if not victims:
                await refuse(server.stream)
                return None
            await cls.evict(victims)
        connection = Connection(server)
        server.stream = WatchedStream(server.stream, connection)
        cls.open.add(connection)
        return connection

    @classmethod
    async def close_stalled_bodies(cls, after: float) -> None:
        """Close, for ever, each connection whose request body has stalled `after` seconds.
        The app answers such a request 408 at --body-timeout, but Hypercorn then waits on
        the client to close a connection whose body never ended, so this does."""
        while True:
            await trio.sleep(SWEEP_EVERY_S)
            now = trio.current_time()
            for connection in [c for c in cls.open if c.stalled_in_body(now, after)]:
                cls.open.discard(connection)
                await connection.close()

    @classmethod
    def longest_stalled(cls, count: int) -> list[Connection]:
        candidates = [c for c in cls.open if c.may_give_way()]
        return heapq.nsmallest(count, candidates, key=lambda c: c.last_read)

    @classmethod
    async def evict(cls, victims: list[Connection]) -> None:
        now = trio.current_time()
        log.warning(
            "http.connections_evicted",
            count=len(victims),
            open=len(cls.open),
            limit=cls.limit,
            stalled_s=round(now - victims[-1].last_read, 3),  # the least stalled of them
        )
        for victim in victims:
            cls.open.discard(victim)
            await victim.close()


async def refuse(stream: trio.abc.Stream) -> None:
    log.warning("http.connection_refused", open=len(Connections.open), limit=Connections.limit)
    with (
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
        trio.move_on_after(1),
    ):
        await stream.send_all(OVER_CAP_RESPONSE)
        # Read what the client sent (for up to that second): closing on unread bytes would
        # reset the connection and lose the answer before the client reads it.
        if isinstance(stream, trio.abc.HalfCloseableStream):
            await stream.send_eof()
        while await stream.receive_some(4096):
            pass
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await stream.aclose()
