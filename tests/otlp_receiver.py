"""A real OTLP/HTTP collector on loopback for tests: it decodes each export's protobuf
(opentelemetry-proto) into plain span records. It can answer, hang (take the request and
never answer), or be down (its port closed: connection refused), and come back on the
same port."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

TRACES_PATH = "/v1/traces"


@dataclass(slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(slots=True)
class ReceivedSpan:
    name: str
    kind: int  # the protobuf's: 2 is SERVER
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[SpanEvent] = field(default_factory=list)


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs}


def spans_of(body: bytes) -> list[ReceivedSpan]:
    export = ExportTraceServiceRequest.FromString(body)
    return [
        ReceivedSpan(
            name=span.name,
            kind=span.kind,
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(),
            start_ns=span.start_time_unix_nano,
            end_ns=span.end_time_unix_nano,
            attributes=attributes_of(span.attributes),
            events=[
                SpanEvent(e.name, e.time_unix_nano, attributes_of(e.attributes))
                for e in span.events
            ],
        )
        for resource in export.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]


class OtlpReceiver:
    """Start with `with OtlpReceiver() as receiver:`; `url` is what --otlp-traces-endpoint
    takes. `hang()`, `down()` and `answer()` switch how it treats the exports to come."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.hanging = threading.Event()
        self.released = threading.Event()  # ends the hung requests (at stop)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0

    def __enter__(self) -> OtlpReceiver:
        self.answer()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self.down()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{TRACES_PATH}"

    def answer(self) -> None:
        self.hanging.clear()
        if self._server is None:
            self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
            self._server.daemon_threads = True
            self.port = self._server.server_address[1]
            threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def hang(self) -> None:
        self.answer()
        self.hanging.set()

    def down(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.name == name]

    def wait_for(
        self, name: str, attribute: str, value: Any, timeout: float = 10.0
    ) -> ReceivedSpan:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.named(name) if s.attributes.get(attribute) == value]
            if found:
                return found[0]
            time.sleep(0.05)
        raise TimeoutError(f"no {name} span with {attribute}={value!r} within {timeout} s")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if receiver.hanging.is_set():
                    receiver.released.wait(60)  # took it, never answers
                    return
                with receiver._lock:
                    receiver.spans += spans_of(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                """Quiet."""

        return Handler
