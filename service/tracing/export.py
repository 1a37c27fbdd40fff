"""Spans out of the process: the SDK's tracer provider, an OTLP exporter (HTTP/protobuf, or
gRPC) and a bounded export queue whose drops are counted.

The SDK's BatchSpanProcessor exports from a thread of its own: that is OpenTelemetry's
standard way, and the one exception to cadence's rule of no threads beside the nursery's
tasks. It is what keeps a collector off the event loop: a finished span is only appended to
a bounded queue there, and only the export thread waits for the collector (at most the
exporter's timeout, OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, 10 s by default, then it gives up).
A collector that is down or hangs therefore costs requests nothing; the spans it does not
take are dropped and counted (cadence:otlp_spans_dropped_total).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.sdk.environment_variables import (
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
    OTEL_BSP_MAX_QUEUE_SIZE,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from service.config import OTLP_PROTOCOLS

HTTP, GRPC = OTLP_PROTOCOLS
HTTP_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces
# the SDK's defaults, which its environment variables override
DEFAULT_MAX_QUEUE = 2048
DEFAULT_MAX_BATCH = 512


def open_provider(
    endpoint: str, protocol: str | None, service_name: str, dropped: Callable[[int], None]
) -> TracerProvider:
    """A tracer provider exporting to `endpoint`; `dropped(n)` is told of every n spans lost
    (queue full, or the collector did not take them). Its own, not the process-global one."""
    protocol, url = resolve_endpoint(endpoint, protocol)
    max_queue = _env_int(OTEL_BSP_MAX_QUEUE_SIZE, DEFAULT_MAX_QUEUE)
    max_batch = min(max_queue, _env_int(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, DEFAULT_MAX_BATCH))
    budget = QueueBudget(max_queue, dropped)
    exporter = CountingExporter(_otlp_exporter(protocol, url), budget)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BoundedSpanProcessor(exporter, budget, max_batch))
    return provider


def resolve_endpoint(endpoint: str, protocol: str | None) -> tuple[str, str]:
    """(protocol, URL): the flag's protocol, else OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's, else
    gRPC for a grpc:// URL (sent as http://) and HTTP/protobuf for any other. An HTTP URL
    without a path gets OTLP's /v1/traces, as the SDK does for its generic endpoint."""
    parts = urlsplit(endpoint)
    if parts.scheme == "grpc":
        parts = parts._replace(scheme="http")
        protocol = protocol or GRPC
    protocol = protocol or os.environ.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or HTTP
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(f"unsupported OTLP protocol {protocol!r}: use one of {OTLP_PROTOCOLS}")
    if protocol == HTTP and parts.path in ("", "/"):
        parts = parts._replace(path=HTTP_TRACES_PATH)
    return protocol, urlunsplit(parts)


def _otlp_exporter(protocol: str, url: str) -> SpanExporter:
    if protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=url, insecure=url.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=url)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


class QueueBudget:
    """Spans handed to the export queue and not yet taken by the exporter, at most `limit`.

    It counts a span out only when the exporter is given it, a moment after the export
    thread took it from the queue, so it never holds fewer than the queue does: with the
    queue as large as the limit, the SDK never drops a span unseen; this does, and counts it."""

    def __init__(self, limit: int, dropped: Callable[[int], None]) -> None:
        self.limit = limit
        self.dropped = dropped
        self._held = 0
        self._lock = threading.Lock()  # the event loop adds, the export thread takes

    def take(self) -> bool:
        with self._lock:
            fits = self._held < self.limit
            self._held += fits
        if not fits:
            self.dropped(1)
        return fits

    def give_back(self, count: int) -> None:
        with self._lock:
            self._held -= count


class BoundedSpanProcessor(BatchSpanProcessor):
    """The SDK's batching processor behind a QueueBudget: a span past it is dropped here."""

    def __init__(self, exporter: SpanExporter, budget: QueueBudget, max_batch: int) -> None:
        super().__init__(exporter, max_queue_size=budget.limit, max_export_batch_size=max_batch)
        self._budget = budget

    def on_end(self, span: ReadableSpan) -> None:
        sampled = span.context is not None and span.context.trace_flags.sampled
        if sampled and self._budget.take():
            super().on_end(span)


class CountingExporter(SpanExporter):
    """An exporter that gives the budget back what it is handed and counts what the
    collector did not take (refused, unreachable, or no answer within the timeout)."""

    def __init__(self, inner: SpanExporter, budget: QueueBudget) -> None:
        self._inner = inner
        self._budget = budget

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._budget.give_back(len(spans))
        result = SpanExportResult.FAILURE
        try:
            result = self._inner.export(spans)
        finally:
            if result is not SpanExportResult.SUCCESS:
                self._budget.dropped(len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)
