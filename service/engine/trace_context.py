"""The W3C trace context (`traceparent`, `tracestate`) of the HTTP request being handled.

The front end sets it once per request, before any route runs (service.api.app), and
Engine.submit reads it into the request, so every route that submits carries its caller's
trace without passing it by hand. A context variable is how OpenTelemetry itself carries a
context through a task; trio gives each HTTP request's task its own copy.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

W3C_HEADERS = ("traceparent", "tracestate")

current: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "cadence_trace_headers", default=None
)


def headers_of(header: Callable[[str], str | None]) -> dict[str, str] | None:
    """The W3C trace headers of a request whose headers `header` looks up by name (None:
    it carries no trace)."""
    found = {name: value for name in W3C_HEADERS if (value := header(name)) is not None}
    return found or None
