"""The engine's reports as spans: one span per request, its story as events, and, when
asked, a span per sampled worker step.

An engine Observer: it gets the very records the engine writes its `request.*` log lines
from (service.engine.reporting), so a trace and the log tell one story. A request's span is
made when it finishes, as vLLM makes its `llm_request` span: started at its arrival, a
child of its caller's `traceparent`, with vLLM's `gen_ai` attributes and an event for each
milestone (admitted, prefill_chunk, preempted, resumed, first_token, largest_gap,
finished). Nothing here waits: ending a span hands it to the export queue (export.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import trio
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.engine.stats import IterationStats, RequestEvent, RequestStats

REQUEST_SPAN = "llm_request"  # vLLM's name
STEP_SPAN = "worker_step"
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = ("traceparent", "tracestate")
# the received line's fields that are vLLM's request attributes
_REQUEST_ATTRIBUTES = {
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "n": "gen_ai.request.n",
    "tenant": "cadence.tenant",
    "priority": "cadence.priority",
}
Attributes = dict[str, str | bool | int | float | list[str]]


@dataclass(slots=True)
class _Story:
    received: Mapping[str, object]  # the `request.received` fields
    events: list[RequestEvent] = field(default_factory=list)


class RequestSpans:
    """Spans from the engine's reports (an engine Observer). `step_ratio`: the fraction of
    worker steps that get a span of their own (0: none)."""

    def __init__(self, tracer: Tracer, model: str, step_ratio: float = 0.0) -> None:
        self._tracer = tracer
        self._model = model
        self._step_ratio = step_ratio
        self._stories: dict[str, _Story] = {}  # live requests: each ends exactly once

    def on_request_event(self, event: RequestEvent) -> None:
        if event.name == "received":
            self._stories[event.request_id] = _Story(event.fields)
        elif (story := self._stories.get(event.request_id)) is not None:
            story.events.append(event)

    def on_request_finished(self, stats: RequestStats) -> None:
        story = self._stories.pop(stats.request_id, None)
        if story is None:
            return
        wall = engine_to_wall_ns()
        headers = {k: str(v) for k, v in story.received.items() if k in _TRACE_HEADERS}
        span = self._tracer.start_span(
            REQUEST_SPAN,
            context=_PROPAGATOR.extract(headers) if headers else None,
            kind=SpanKind.SERVER,
            attributes=self._request_attributes(stats, story.received),
            start_time=wall(stats.received),
        )
        for event in story.events:
            span.add_event(event.name, _attributes(event.fields), wall(event.at))
        gap = stats.largest_gap
        if gap is not None:
            index, seconds = gap
            at = wall(stats.token_times[index])
            span.add_event("largest_gap", {"gap_ms": seconds * 1000, "token": index}, at)
        finished = {"finish_reason": stats.finish_reason, "finish_detail": stats.finish_detail}
        span.add_event("finished", finished, wall(stats.finished))
        span.end(wall(stats.finished))

    def _request_attributes(
        self, stats: RequestStats, received: Mapping[str, object]
    ) -> Attributes:
        phases = stats.phases
        values: dict[str, object] = {
            "gen_ai.response.model": self._model,
            "gen_ai.request.id": stats.request_id,
            "gen_ai.usage.prompt_tokens": stats.prompt_tokens,
            "gen_ai.usage.completion_tokens": stats.completion_tokens,
            "gen_ai.usage.cached_tokens": stats.cached_tokens,
            "gen_ai.response.finish_reasons": [stats.finish_reason],
            "gen_ai.latency.time_in_queue": phases.queue,
            "gen_ai.latency.time_to_first_token": stats.ttft,
            "gen_ai.latency.e2e": stats.e2e,
            "gen_ai.latency.time_in_model_prefill": phases.prefill,
            "gen_ai.latency.time_in_model_decode": phases.decode,
            "cadence.policy": stats.policy,
            "cadence.preemptions": stats.preemptions,
            "cadence.finish_detail": stats.finish_detail,
        }
        for key, name in _REQUEST_ATTRIBUTES.items():
            values[name] = received.get(key)
        return _attributes(values)

    def on_iteration(self, stats: IterationStats) -> None:
        if not self._samples_step(stats.iteration):
            return
        end = time.time_ns()
        span = self._tracer.start_span(
            STEP_SPAN,
            kind=SpanKind.INTERNAL,
            attributes=_attributes(
                {
                    "cadence.iteration": stats.iteration,
                    "cadence.policy": stats.policy,
                    "cadence.step.num_seqs": stats.num_seqs,
                    "cadence.step.batch_tokens": stats.batch_tokens,
                    "cadence.step.prefill_tokens": stats.prefill_tokens,
                    "cadence.step.decode_seqs": stats.decode_seqs,
                    "cadence.step.step_ms": stats.step_ms,
                    "cadence.step.schedule_ms": stats.schedule_ms,
                }
            ),
            start_time=end - int(stats.step_ms * 1e6),
        )
        span.end(end)

    def _samples_step(self, iteration: int) -> bool:
        """Exactly `step_ratio` of the steps, evenly spread (no randomness to reason about)."""
        ratio = self._step_ratio
        return ratio > 0 and math.floor(iteration * ratio) != math.floor((iteration - 1) * ratio)

    # the rest of the Observer protocol: milestones reach us as RequestEvents
    def on_request_received(self, request_id: str, tenant: str, prompt_tokens: int) -> None: ...
    def on_preemption(self, request_id: str) -> None: ...
    def on_policy_swap(self, old: str, new: str, iteration: int) -> None: ...
    def on_request_refused(self, reason: str) -> None: ...


def engine_to_wall_ns() -> Callable[[float], int]:
    """Engine-clock seconds (trio.current_time()) to wall-clock nanoseconds, as of now."""
    wall_now, engine_now = time.time_ns(), trio.current_time()
    return lambda at: wall_now - int((engine_now - at) * 1e9)


def _attributes(values: Mapping[str, object]) -> Attributes:
    """Span attributes: OpenTelemetry takes no None, and only plain values."""
    kept: Attributes = {}
    for key, value in values.items():
        if isinstance(value, str | bool | int | float | list):
            kept[key] = value
    return kept
