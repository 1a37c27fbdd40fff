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

Keys and tenants may cap their open connections (`connections=N`, `tenant-connections=N` in
--api-key-file): a connection counts as a key's (and its tenant's) from the first request
it sends with that key until it closes, idle or not, since a hoarder's idle connections are
what the cap is for. A request that would make one more is answered 429
`too_many_connections` and its connection closed after the answer (service.api.access):
the newcomer gives way, never a connection the key already has, a stream in flight least.
"""

from __future__ import annotations

import contextlib
import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h11
import orjson
import structlog
import trio
from hypercorn.utils import parse_socket_addr

from service.api.errors import error_body
from service.config import ApiKey

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
    """One client connection: its Hypercorn server, its client's address (the ASGI scope's
    `client`), when it last sent the server bytes, and the key its requests came with."""

    server: Any  # hypercorn.trio.tcp_server.TCPServer
    peer: tuple[str, int] | None
    last_read: float = field(default_factory=trio.current_time)
    holder: ApiKey | None = None

    def _protocol(self) -> Any:
        """Hypercorn's protocol of it (HTTP/1.1 or 2); None: accepted, not yet reading."""
        return getattr(getattr(self.server, "protocol", None), "protocol", None)

    def _h11(self) -> h11.Connection | None:
        connection = getattr(self._protocol(), "connection", None)
        return connection if isinstance(connection, h11.Connection) else None

    def may_give_way(self) -> bool:
        """Nothing of it is being answered (an HTTP/2 connection never gives way)."""
        connection = self._h11()
        if connection is None:
            return self._protocol() is None  # accepted, not yet reading: nothing asked
        return connection.their_state in WAITING_ON_CLIENT and connection.our_state in NOT_ANSWERING

    def in_body(self) -> bool:
        """Its request's head has come, its body not all."""
        connection = self._h11()
        return connection is not None and connection.their_state is h11.SEND_BODY

    def stalled_in_body(self, now: float, after: float) -> bool:
        """Its request body has not moved for `after` seconds, and nothing is being sent."""
        connection = self._h11()
        return (
            connection is not None
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
        if not data and self._connection.in_body():
            # As nginx: a client that ends its side with a body half sent has abandoned its
            # request; the connection is closed unanswered. (Hypercorn would answer a 400
            # into the closed socket: 2,048 hoarders leaving at once made that a freeze of
            # a second for every stream.)
            raise trio.BrokenResourceError("the client closed its side mid-body")
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Connections:
    """The open connections (one trio run: Hypercorn's serving loop)."""

    limit: int | None = None
    open: set[Connection] = set()
    by_peer: dict[tuple[str, int], Connection] = {}
    held_by_key: Counter[ApiKey] = Counter()
    held_by_tenant: Counter[str] = Counter()

    @classmethod
    async def admit(cls, server: Any) -> Connection | None:
        """The new connection's record, room made for it; None: refused (503, closed)."""
        if cls.limit is not None and len(cls.open) >= cls.limit:
            victims = cls.longest_stalled(max(1, cls.limit // EVICTED_AT_ONCE))
            if not victims:
                await refuse(server.stream)
                return None
            await cls.evict(victims)
        connection = Connection(server, peer_of(server.stream))
        server.stream = WatchedStream(server.stream, connection)
        cls.open.add(connection)
        if connection.peer is not None:
            cls.by_peer[connection.peer] = connection
        return connection

    @classmethod
    def forget(cls, connection: Connection) -> None:
        """A closed connection: out of the count, and of its key's and tenant's."""
        cls.open.discard(connection)
        if connection.peer is not None and cls.by_peer.get(connection.peer) is connection:
            del cls.by_peer[connection.peer]
        cls._release(connection)

    @classmethod
    def claim(cls, peer: tuple[str, int] | None, key: ApiKey) -> str | None:
        """Count the connection from `peer` as `key`'s; why not (a cap it would pass), or
        None. A connection the server does not hold (no address) is not counted."""
        connection = cls.by_peer.get(peer) if peer is not None else None
        if connection is None or connection.holder == key:
            return None
        over = cls._over_cap(key)
        if over is not None:
            return over
        cls._release(connection)
        connection.holder = key
        cls.held_by_key[key] += 1
        cls.held_by_tenant[key.tenant] += 1
        return None

    @classmethod
    def _over_cap(cls, key: ApiKey) -> str | None:
        if key.max_connections is not None and cls.held_by_key[key] >= key.max_connections:
            return (
                f"this API key has {key.max_connections} connections open, its cap: "
                "send on one of them, or close one first"
            )
        cap = key.tenant_max_connections
        if cap is not None and cls.held_by_tenant[key.tenant] >= cap:
            return (
                f"tenant {key.tenant!r} has {cap} connections open, its cap: "
                "send on one of them, or close one first"
            )
        return None

    @classmethod
    def _release(cls, connection: Connection) -> None:
        key, connection.holder = connection.holder, None
        if key is not None:
            cls.held_by_key[key] -= 1
            cls.held_by_tenant[key.tenant] -= 1

    @classmethod
    async def close_stalled_bodies(cls, after: float) -> None:
        """Close, for ever, each connection whose request body has stalled `after` seconds.
        The app answers such a request 408 at --body-timeout, but Hypercorn then waits on
        the client to close a connection whose body never ended, so this does."""
        while True:
            await trio.sleep(SWEEP_EVERY_S)
            now = trio.current_time()
            for connection in [c for c in cls.open if c.stalled_in_body(now, after)]:
                cls.forget(connection)
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
            cls.forget(victim)
            await victim.close()


def peer_of(stream: Any) -> tuple[str, int] | None:
    """The client's address as Hypercorn puts it in the ASGI scope; None: none (gone, or
    not a TCP socket)."""
    # under TLS, the TCP stream's socket; a stream without one (a test's) has no address
    sock = getattr(getattr(stream, "transport_stream", stream), "socket", None)
    if sock is None:
        return None
    with contextlib.suppress(OSError):
        return parse_socket_addr(sock.family, sock.getpeername())
    return None


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
