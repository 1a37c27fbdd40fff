"""service.tracing.export without a server: the bounded export queue drops and counts what
does not fit while the collector is slow, failed exports are counted, endpoints resolve to
a protocol (a grpc:// one exports to a real gRPC collector), and the SDK is needed only
when traces are asked for."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from service.tracing.export import (
    BoundedSpanProcessor,
    CountingExporter,
    QueueBudget,
    _otlp_exporter,
    open_provider,
    resolve_endpoint,
)
from tests.server_fixtures import REPO_ROOT


class SlowCollector(SpanExporter):
    """Takes a batch and holds it until released, like a collector that does not answer."""

    def __init__(self, result: SpanExportResult = SpanExportResult.SUCCESS) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.result = result
        self.exported: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        self.exported += [span.name for span in spans]
        return self.result


def tracer_to(collector: SpanExporter, limit: int) -> tuple[TracerProvider, list[int]]:
    dropped: list[int] = []
    budget = QueueBudget(limit, dropped.append)
    provider = TracerProvider()
    exporter = CountingExporter(collector, budget)
    provider.add_span_processor(BoundedSpanProcessor(exporter, budget, max_batch=1))
    return provider, dropped


def end_span(provider: TracerProvider, name: str) -> None:
    provider.get_tracer("test").start_span(name).end()


def test_spans_past_the_queue_are_dropped_and_counted_while_the_collector_hangs() -> None:
    collector = SlowCollector()
    provider, dropped = tracer_to(collector, limit=2)
    end_span(provider, "first")
    assert collector.entered.wait(10)  # the export thread holds "first" at the collector
    for name in ("a", "b", "c", "d"):  # nothing waits for the collector here
        end_span(provider, name)
    assert sum(dropped) == 2  # "a" and "b" are queued; "c" and "d" did not fit
    collector.release.set()
    provider.shutdown()
    assert collector.exported == ["first", "a", "b"]
    assert sum(dropped) == 2


def test_spans_the_collector_did_not_take_are_counted() -> None:
    collector = SlowCollector(SpanExportResult.FAILURE)
    collector.release.set()
    provider, dropped = tracer_to(collector, limit=8)
    for name in ("a", "b", "c"):
        end_span(provider, name)
    provider.shutdown()
    assert collector.exported == ["a", "b", "c"] and sum(dropped) == 3


@pytest.mark.parametrize(
    ("endpoint", "flag", "expected"),
    [
        ("http://h:4318", None, ("http/protobuf", "http://h:4318/v1/traces")),
        ("http://h:4318/v1/traces", None, ("http/protobuf", "http://h:4318/v1/traces")),
        ("http://h:9/custom", None, ("http/protobuf", "http://h:9/custom")),
        ("grpc://h:4317", None, ("grpc", "http://h:4317")),
        ("http://h:4317", "grpc", ("grpc", "http://h:4317")),
    ],
)
def test_an_endpoint_resolves_to_a_protocol_and_url(
    endpoint: str, flag: str | None, expected: tuple[str, str]
) -> None:
    assert resolve_endpoint(endpoint, flag) == expected


def test_the_protocol_picks_the_otlp_exporter() -> None:
    assert isinstance(_otlp_exporter("grpc", "http://127.0.0.1:4317"), GrpcExporter)
    assert isinstance(_otlp_exporter("http/protobuf", "http://h/v1/traces"), OTLPSpanExporter)


class GrpcCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.names: list[str] = []

    def Export(self, request: Any, context: Any) -> ExportTraceServiceResponse:
        self.names += [
            s.name for r in request.resource_spans for sc in r.scope_spans for s in sc.spans
        ]
        return ExportTraceServiceResponse()


def test_a_grpc_url_exports_over_grpc() -> None:
    collector = GrpcCollector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        dropped: list[int] = []
        provider = open_provider(f"grpc://127.0.0.1:{port}", None, "test", dropped.append)
        end_span(provider, "over-grpc")
        provider.shutdown()
    finally:
        server.stop(None)
    assert collector.names == ["over-grpc"] and not dropped


def test_serve_refuses_the_endpoint_flag_without_the_sdk(tmp_path: Path) -> None:
    """An `opentelemetry` package without the SDK (only the API, as other packages pull in)."""
    (tmp_path / "opentelemetry").mkdir()
    (tmp_path / "opentelemetry" / "__init__.py").write_text("")
    command = [sys.executable, "-m", "service.cli", "serve", "--otlp-traces-endpoint", "http://h"]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": f"{tmp_path}:{REPO_ROOT}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2
    assert "pip install 'cadence[otel]'" in done.stderr


def test_nothing_imports_the_sdk_without_the_flag() -> None:
    code = (
        "import sys, service.cli, service.server, service.api.app\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')]"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)
