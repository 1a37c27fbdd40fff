"""The W3C trace context (`traceparent`, `tracestate`) of the HTTP request being handled.

The front end sets it once per request, before any route runs (service.api.app), and
Engine.submit reads it into the request, so every route that submits carries its caller's
trace without passing it by hand. A context variable is how OpenTelemetry itself carries a
context through a task; trio gives each HTTP request's task its own copy.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping

W3C_HEADERS = ("traceparent", "tracestate")

current: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "cadence_trace_headers", default=None
)


def headers_of(all_headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace headers among a request's (None: it carries no trace)."""
    found = {name: all_headers[name] for name in W3C_HEADERS if name in all_headers}
    return found or None
