"""Request bodies: routes read them through `read_body`, and the app reads to its end any
body a route left unread before it answers.

Hypercorn sends an answer given before the body has fully arrived (a 401, 404, 405 or 415
needs no body) and then leaves the late body bytes in front of the next request on that
keep-alive connection, which never gets an answer: the schemathesis fuzz run hung on this.
"""

from __future__ import annotations

from quart import g, request
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout


async def read_body() -> bytes:
    """The whole request body (413 beyond the app's MAX_CONTENT_LENGTH, 408 when it has not
    all come within BODY_TIMEOUT)."""
    try:
        data = await request.get_data(cache=False, as_text=False)
    except RequestTimeout:
        g.body_stalled = True  # not waited for twice: the connection closes instead
        raise
    g.body_read = True
    assert isinstance(data, bytes)
    return data


async def drain_unread_body() -> bool:
    """Read a body the route left unread to its end; False when it is too large to be, or
    too slow to come, and the connection must be closed instead."""
    if g.get("body_stalled", False):
        return False
    if not body_left_unread():
        return True
    try:
        await read_body()
    except (RequestEntityTooLarge, RequestTimeout):
        return False
    return True


def body_left_unread() -> bool:
    chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    declared = chunked or (request.content_length or 0) > 0
    return declared and not g.get("body_read", False)
