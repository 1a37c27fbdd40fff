"""OpenTelemetry traces from a real server (--otlp-traces-endpoint) to a real OTLP/HTTP
receiver on loopback (tests/otlp_receiver.py): a caller's `traceparent` makes the request's
span a child, with vLLM's gen_ai attributes and cadence's scheduling story as events, which
`cadence logs story` tells the same way from the JSON log; a preempted request's span shows
it; a collector that hangs or is down costs requests nothing and its lost spans are counted.
One server (one sequence at a time, 16-token steps, so that prompts take several chunks and
an urgent request preempts), shared by the module."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.server_fixtures import REPO_ROOT, RunningServer, start_server, stop_server

pytestmark = pytest.mark.real_model

STEP_RATIO = 0.25  # every 4th worker step gets a span
SERVER_SPAN = 2  # OTLP's SpanKind.SPAN_KIND_SERVER
DROPPED = "cadence:otlp_spans_dropped_total"
# the exporter waits 1 s for a collector (not 10), and exports every 50 ms (not 5 s)
EXPORT_ENV = {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1", "OTEL_BSP_SCHEDULE_DELAY": "50"}
PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle, "
    "and tell it in the voice of the keeper's old dog, please."
)


@dataclass(slots=True)
class Traced:
    server: RunningServer
    receiver: OtlpReceiver


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    with OtlpReceiver() as receiver, pytest.MonkeyPatch.context() as env:
        for name, value in EXPORT_ENV.items():
            env.setenv(name, value)  # the server inherits them
        server = start_server(
            tmp_path_factory.mktemp("traced"),
            "--otlp-traces-endpoint", receiver.url,
            "--otlp-trace-steps", str(STEP_RATIO),
            "--enable-per-request-metrics",
            "--policy", "priority", "--policy-param", "aging_rate=0",
            "--max-num-seqs", "1", "--max-batched-tokens", "16",
        )  # fmt: skip
        yield Traced(server, receiver)
        stop_server(server)


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def story_from_logs(server: RunningServer, request_id: str) -> list[dict]:
    """`cadence logs story LOG ID --json`, as an operator runs it."""
    command = [sys.executable, "-m", "service.cli", "logs", "story"]
    command += [str(server.log_file), request_id, "--json"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, check=True, timeout=60)
    return [orjson.loads(line) for line in done.stdout.splitlines()]


def test_a_callers_traceparent_makes_the_request_span_a_child_with_its_story(
    traced: Traced,
) -> None:
    server, receiver = traced.server, traced.receiver
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    reply = client(server).completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, temperature=0.0,
        extra_headers={"traceparent": traceparent(trace_id, parent), "tracestate": "k=v"},
        extra_body={"ignore_eos": True, "top_p": 0.9},
    )  # fmt: skip
    span = receiver.wait_for("llm_request", "gen_ai.request.id", reply.id)
    assert (span.trace_id, span.parent_span_id, span.kind) == (trace_id, parent, SERVER_SPAN)
    usage, attributes = reply.usage, span.attributes
    assert usage is not None
    assert attributes["gen_ai.response.model"] == server.model
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.request.n"] == 1
    assert attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens == 6
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["cadence.policy"] == "priority"
    assert span.end_ns - span.start_ns == pytest.approx(attributes["gen_ai.latency.e2e"] * 1e9)

    names = [event.name for event in span.events]
    chunks = [event.attributes for event in span.events if event.name == "prefill_chunk"]
    middle = ["prefill_chunk"] * len(chunks)
    assert names == ["admitted", *middle, "first_token", "largest_gap", "finished"]
    assert len(chunks) >= 2 and all(chunk["tokens"] <= 16 for chunk in chunks)
    starts = [chunk["start"] for chunk in chunks]
    assert starts == [sum(c["tokens"] for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(chunk["tokens"] for chunk in chunks) == usage.prompt_tokens
    assert span.events[0].attributes["policy"] == "priority"
    assert span.events[-1].attributes == {"finish_reason": "length", "finish_detail": "max_tokens"}

    # the response's own timings (vLLM's `metrics`) are the span's, in ms
    metrics = reply.model_extra["metrics"]  # type: ignore[index]
    assert metrics["queue_time_ms"] == pytest.approx(
        attributes["gen_ai.latency.time_in_queue"] * 1000
    )
    assert metrics["time_to_first_token_ms"] == pytest.approx(
        attributes["gen_ai.latency.time_in_model_prefill"] * 1000
    )
    assert metrics["generation_time_ms"] == pytest.approx(
        attributes["gen_ai.latency.time_in_model_decode"] * 1000
    )
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / 5)

    # and the JSON log, read by `cadence logs story`, tells the very same story
    story = story_from_logs(server, reply.id)
    assert story[0]["name"] == "received" and story[0]["traceparent"].endswith(f"{parent}-01")
    told = [(m["name"], {k: v for k, v in m.items() if k not in ("name", "ts")}) for m in story]
    assert told[1:] == [(event.name, event.attributes) for event in span.events]


def metrics_match_span(metrics: dict, span: ReceivedSpan) -> bool:
    """vLLM's per-request `metrics` are the span's latencies, in ms."""
    seconds = {
        "queue_time_ms": "gen_ai.latency.time_in_queue",
        "time_to_first_token_ms": "gen_ai.latency.time_in_model_prefill",
        "generation_time_ms": "gen_ai.latency.time_in_model_decode",
    }
    return all(
        metrics[key] == pytest.approx(span.attributes[name] * 1000) for key, name in seconds.items()
    )


def streamed_response(server: RunningServer, headers: dict[str, str]) -> dict:
    """The final response of a streamed /v1/responses (its response.completed event, or
    response.incomplete at max_output_tokens)."""
    body = {"model": server.model, "input": "Hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json=body, headers=headers, timeout=60
    ) as reply:
        events = [
            orjson.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")
        ]
    (done,) = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
    return done["response"]


def test_every_route_that_generates_honours_traceparent_and_reports_metrics(
    traced: Traced,
) -> None:
    server, receiver, ai = traced.server, traced.receiver, client(traced.server)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parents = {
        "chat": "00f067aa0ba902b7",
        "responses": "00f067aa0ba902b8",
        "responses stream": "00f067aa0ba902ba",
        "embed": "00f067aa0ba902b9",
    }
    headers = {name: {"traceparent": traceparent(trace_id, span)} for name, span in parents.items()}
    chunks = list(
        ai.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            stream=True, stream_options={"include_usage": True}, extra_headers=headers["chat"],
        )
    )  # fmt: skip
    answer = httpx.post(
        f"{server.url}/v1/responses", headers=headers["responses"], timeout=60,
        json={"model": server.model, "input": "Hi", "max_output_tokens": 2},
    ).json()  # fmt: skip
    streamed = streamed_response(server, headers["responses stream"])
    ai.embeddings.create(model=server.model, input="Hi", extra_headers=headers["embed"])
    metrics = {
        "chat": (chunks[-1].id, chunks[-1].model_extra["metrics"]),  # type: ignore[index]
        "responses": (answer["id"], answer["metrics"]),
        "responses stream": (streamed["id"], streamed["metrics"]),
    }
    for name, (request_id, reported) in metrics.items():
        span = receiver.wait_for("llm_request", "gen_ai.request.id", request_id)
        assert (span.trace_id, span.parent_span_id) == (trace_id, parents[name])
        assert metrics_match_span(reported, span), name
    deadline = time.monotonic() + 10
    while not [s for s in receiver.named("llm_request") if s.parent_span_id == parents["embed"]]:
        assert time.monotonic() < deadline, "the embedding request's span never came"
        time.sleep(0.05)
    two = ai.completions.create(model=server.model, prompt="Hi", max_tokens=2, n=2)
    assert two.model_extra["metrics"] is None  # type: ignore[index]  # as vLLM: one stream's


def test_a_preempted_requests_span_shows_its_preemption_and_resumption(traced: Traced) -> None:
    """One slot, held by a priority-5 stream: a priority-0 request preempts it (the
    `priority` policy), and the stream's span tells so: preempted, resumed, its prompt and
    output computed again in chunks, and then its remaining tokens."""
    server, receiver, ai = traced.server, traced.receiver, client(traced.server)
    stream = ai.completions.create(
        model=server.model, prompt="List 5 fruits:", max_tokens=12, temperature=0.0,
        stream=True, extra_body={"priority": 5, "ignore_eos": True},
    )  # fmt: skip
    minor = iter(stream)
    first = next(minor)  # it holds the only slot now
    ai.completions.create(
        model=server.model, prompt="Say 0.", max_tokens=2, temperature=0.0,
        extra_body={"priority": 0, "ignore_eos": True},
    )  # fmt: skip
    for _ in minor:
        pass
    span = receiver.wait_for("llm_request", "gen_ai.request.id", first.id)
    names = [event.name for event in span.events]
    assert span.attributes["cadence.preemptions"] >= 1
    assert "preempted" in names and "resumed" in names
    preempted, resumed = names.index("preempted"), names.index("resumed")
    assert names.index("first_token") < preempted < resumed
    assert names[resumed + 1] == "prefill_chunk"  # recomputed: prompt and tokens so far
    event = span.events[preempted].attributes
    assert event["num_generated"] >= 1 and event["iteration"] > 0


def test_worker_steps_are_spans_of_their_own_when_asked(traced: Traced) -> None:
    steps = traced.receiver.named("worker_step")
    assert steps, "no step spans (earlier tests ran steps)"
    for span in steps:
        attributes = span.attributes
        assert attributes["cadence.iteration"] % round(1 / STEP_RATIO) == 0
        assert attributes["cadence.step.num_seqs"] >= 1
        assert attributes["cadence.step.batch_tokens"] >= 1
        assert span.end_ns - span.start_ns == pytest.approx(
            attributes["cadence.step.step_ms"] * 1e6, abs=1
        )


def dropped_spans(server: RunningServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == DROPPED:
                return sample.value
    raise AssertionError(f"{DROPPED} is missing")


def wait_for_more_dropped(server: RunningServer, before: float, timeout: float = 15) -> float:
    deadline = time.monotonic() + timeout
    while (now := dropped_spans(server)) <= before:
        assert time.monotonic() < deadline, "the collector's lost spans were not counted"
        time.sleep(0.1)
    return now


def test_a_hanging_or_dead_collector_costs_requests_nothing_and_lost_spans_are_counted(
    traced: Traced,
) -> None:
    server, receiver, ai = traced.server, traced.receiver, client(traced.server)

    def ask() -> None:
        reply = ai.completions.create(model=server.model, prompt="Hi", max_tokens=4)
        assert reply.usage is not None and reply.usage.completion_tokens == 4

    before = dropped_spans(server)
    receiver.hang()  # it takes the export and never answers
    for _ in range(3):
        ask()
    during_hang = wait_for_more_dropped(server, before)
    receiver.down()  # connection refused
    for _ in range(3):
        ask()
    wait_for_more_dropped(server, during_hang)
    receiver.answer()
    reply = ai.completions.create(model=server.model, prompt="Hello", max_tokens=2)
    span = receiver.wait_for("llm_request", "gen_ai.request.id", reply.id)
    assert span.parent_span_id == ""  # no traceparent: a root span
