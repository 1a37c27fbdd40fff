"""A request's story as the engine reports it (service.engine.reporting): one RequestEvent
per milestone, the same record its `request.*` log line is written from, and the span
service.tracing.spans makes of it (the SDK's in-memory exporter). Simulated worker."""

from __future__ import annotations

from collections import defaultdict

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.engine import trace_context
from service.engine.stats import RequestEvent
from service.tracing.spans import RequestSpans
from tests import sim_worker as sim

TRACE_ID, PARENT = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def stories(events: list[RequestEvent]) -> dict[str, list[RequestEvent]]:
    by_request = defaultdict(list)
    for event in events:
        by_request[event.request_id].append(event)
    return by_request


async def test_chunks_preemption_and_resumption_are_told_once_each_and_become_span_events(
    autojump_clock,
):
    """Three 40-token prompts, 16-token steps, a KV cache for two: each prompt is told in
    chunks that cover it, a preempted request is told preempted and then resumed, and each
    span carries the story the observer heard, as a child of the caller's trace."""
    observer, exporter = sim.RecordingObserver(), InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = sim.sim_config(watermark=0.0, max_batched_tokens=16)
    async with sim.running_engine(config, sim.SimWorker(num_blocks=10)) as engine:
        engine.add_observer(observer)
        engine.add_observer(RequestSpans(provider.get_tracer("test"), "sim"))
        trace_context.current.set({"traceparent": f"00-{TRACE_ID}-{PARENT}-01"})
        channels = [
            await engine.submit([i + 1] * 40, sim.greedy(40), request_id=f"p{i}") for i in range(3)
        ]
        for channel in channels:
            await sim.collect(channel)
    assert observer.preempted, "no preemption happened"
    told = stories(observer.events)
    spans = {span.attributes["gen_ai.request.id"]: span for span in exporter.get_finished_spans()}
    for request_id, story in told.items():
        names = [event.name for event in story]
        assert names[:2] == ["received", "admitted"]
        assert story[0].fields["traceparent"].startswith(f"00-{TRACE_ID}-{PARENT}")
        first_token = names.index("first_token")
        first_chunks = [e.fields for e in story[:first_token] if e.name == "prefill_chunk"]
        sizes = [c["tokens"] for c in first_chunks]
        assert [c["start"] for c in first_chunks] == [sum(sizes[:i]) for i in range(len(sizes))]
        assert sum(sizes) == 40 and len(sizes) >= 3 and max(sizes) <= 16
        assert (
            names.count("preempted")
            == names.count("resumed")
            == observer.preempted.count(request_id)
        )
        for at, name in enumerate(names):
            if name == "preempted":
                assert "resumed" in names[at + 1 :]
        span = spans[request_id]
        context = span.parent
        assert context is not None and f"{context.span_id:016x}" == PARENT
        assert f"{span.context.trace_id:032x}" == TRACE_ID
        span_story = [(e.name, dict(e.attributes or {})) for e in span.events]
        heard = [(e.name, dict(e.fields)) for e in story[1:]]
        assert span_story[: len(heard)] == heard
        assert [name for name, _ in span_story[len(heard) :]] == ["largest_gap", "finished"]
