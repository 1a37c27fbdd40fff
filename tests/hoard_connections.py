"""A client that hoards connections (run as a process of its own, so that its work on
thousands of sockets is not the measuring client's):

    python -m tests.hoard_connections URL COUNT SECONDS [HEAD]

Opens COUNT connections to URL, sends HEAD (a request head, as text with \\r\\n escapes;
none: nothing) on each, prints "ready" with how many are open, holds them SECONDS, exits.
"""

from __future__ import annotations

import contextlib
import sys
from urllib.parse import urlsplit

import trio


async def hoard(url: str, count: int, seconds: float, head: bytes) -> None:
    parts = urlsplit(url)
    streams: list[trio.SocketStream] = []

    async def one() -> None:
        with contextlib.suppress(OSError, trio.BrokenResourceError):
            stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
            streams.append(stream)
            if head:
                await stream.send_all(head)

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    print(f"ready {len(streams)}", flush=True)
    await trio.sleep(seconds)


def main() -> None:
    url, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    head = sys.argv[4].encode().decode("unicode_escape").encode() if len(sys.argv) > 4 else b""
    trio.run(hoard, url, count, seconds, head)


if __name__ == "__main__":
    main()
