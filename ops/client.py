"""A streaming OpenAI client (trio + httpx) that times every token chunk.

`run_workload` sends /v1/completions requests; `send_chat` sends one /v1/chat/completions
request, for drivers that build each request from the answer to the one before.

Each request is sent at its scheduled arrival (optionally bounded by a concurrency limit);
one failed request is recorded with its error and never stops the run. All times are
seconds since the start of the run, on trio's monotonic clock.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import trio


@dataclass(slots=True)
class RequestSpec:
    index: int
    arrival_s: float  # scheduled send time, seconds after the run starts
    prompt: str
    prompt_len: int  # tokens, as built by the prompt maker
    max_tokens: int
    role: str = "request"  # scenario-specific: "decoder", "injected", "heavy", "light", ...
    tenant: str | None = None
    priority: int | None = None
    response_format: dict[str, Any] | None = None  # structured output, as OpenAI's field
    model: str | None = None  # a LoRA adapter's name; None: the run's model


@dataclass(slots=True)
class RequestRecord:
    index: int
    role: str
    tenant: str | None
    arrival_s: float
    prompt_len: int
    max_tokens: int
    send_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty chunk
    completion_tokens: int | None = None  # from the server's usage, when it sends one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_s is not None

    @property
    def output_tokens(self) -> int:
        return (
            self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)
        )


@dataclass(slots=True)
class ClientConfig:
    base_url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0  # whole-request limit
    connect_timeout_s: float = 10.0
    concurrency: int | None = None  # None: no limit beyond the schedule
    temperature: float = 0.0
    ignore_eos: bool = True


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    started_unix: float


def api_root(url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all name the same server."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def discover_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model the server lists under /v1/models."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        response = await client.get(
            f"{api_root(base_url)}/v1/models", headers=auth_headers(api_key)
        )
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url} lists no models")
    return str(models[0]["id"])


async def set_policy(
    base_url: str, name: str, params: dict | None, admin_token: str | None
) -> dict:
    """Swap the scheduling policy of a cadence server through its admin API."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.put(
            f"{api_root(base_url)}/admin/policy",
            json={"name": name, "params": params or {}},
            headers=auth_headers(admin_token),
        )
    if response.status_code >= 400:
        raise ValueError(
            f"policy change to {name!r} refused ({response.status_code}): {response.text}"
        )
    return response.json()


def _generation_fields(config: ClientConfig, max_tokens: int) -> dict[str, Any]:
    return {
        "model": config.model,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": config.temperature,
        "ignore_eos": config.ignore_eos,
        "stream_options": {"include_usage": True},
    }


def request_body(config: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    body = {**_generation_fields(config, spec.max_tokens), "prompt": spec.prompt}
    if spec.tenant is not None:
        body["user"] = spec.tenant
    if spec.priority is not None:
        body["priority"] = spec.priority
    if spec.response_format is not None:
        body["response_format"] = spec.response_format
    if spec.model is not None:
        body["model"] = spec.model
    return body


def chat_request_body(
    config: ClientConfig, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    return {**_generation_fields(config, max_tokens), "messages": messages}


def request_headers(config: ClientConfig, spec: RequestSpec) -> dict[str, str]:
    headers = auth_headers(config.api_key)
    if spec.tenant is not None:
        headers["X-Tenant"] = spec.tenant
    return headers


def new_record(spec: RequestSpec) -> RequestRecord:
    return RequestRecord(
        index=spec.index,
        role=spec.role,
        tenant=spec.tenant,
        arrival_s=spec.arrival_s,
        prompt_len=spec.prompt_len,
        max_tokens=spec.max_tokens,
    )


def apply_event(record: RequestRecord, payload: dict[str, Any], at: float) -> str:
    """Fold one SSE `data:` object into the record (completions or chat chunk shapes);
    returns the text the event carried ('' when none)."""
    if payload.get("error"):
        error = payload["error"]
        record.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return ""
    text = None
    choices = payload.get("choices") or []
    if choices:
        choice = choices[0]
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            if record.first_token_s is None:
                record.first_token_s = at
            record.chunk_times.append(at)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = payload.get("usage")
    if usage:
        record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens", record.cached_tokens)
    return text or ""


async def _stream_events(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    record: RequestRecord,
    t0: float,
) -> str:
    """POST `body` and fold its SSE stream into `record`; returns the streamed text."""
    pieces: list[str] = []
    async with client.stream("POST", url, json=body, headers=headers) as response:
        record.status = response.status_code
        if response.status_code != 200:
            error_body = (await response.aread()).decode("utf-8", "replace")
            record.error = f"HTTP {response.status_code}: {error_body[:300]}"
            return ""
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            pieces.append(apply_event(record, orjson.loads(data), trio.current_time() - t0))
            if record.error is not None:
                break
    return "".join(pieces)


async def send_timed(
    client: httpx.AsyncClient,
    config: ClientConfig,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    record: RequestRecord,
    t0: float,
) -> str:
    """Send one streaming request now, timing it into `record`; returns the streamed text.
    A failure or timeout is recorded in `record.error`, never raised."""
    record.send_s = trio.current_time() - t0
    text = ""
    with trio.move_on_after(config.timeout_s) as scope:
        try:
            text = await _stream_events(
                client, f"{api_root(config.base_url)}{path}", body, headers, record, t0
            )
        except Exception as exc:  # one failed request is data, not a reason to stop the run
            record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if scope.cancelled_caught:
        record.error = f"timeout after {config.timeout_s:g} s"
    record.end_s = trio.current_time() - t0
    if record.error is None and record.first_token_s is None:
        record.error = "stream ended without any token"
    return text


async def send_chat(
    client: httpx.AsyncClient,
    config: ClientConfig,
    messages: list[dict[str, str]],
    max_tokens: int,
    record: RequestRecord,
    t0: float,
) -> str:
    """One streaming /v1/chat/completions request, timed into `record`; returns the
    assistant's text as it arrived (check `record.ok` before building on it)."""
    body = chat_request_body(config, messages, max_tokens)
    headers = auth_headers(config.api_key)
    return await send_timed(client, config, "/v1/chat/completions", body, headers, record, t0)


async def _run_one(
    client: httpx.AsyncClient,
    config: ClientConfig,
    spec: RequestSpec,
    record: RequestRecord,
    t0: float,
    limiter: trio.CapacityLimiter | None,
) -> None:
    await trio.sleep_until(t0 + spec.arrival_s)
    async with limiter if limiter is not None else contextlib.nullcontext():
        body, headers = request_body(config, spec), request_headers(config, spec)
        await send_timed(client, config, "/v1/completions", body, headers, record, t0)


def open_client(config: ClientConfig) -> httpx.AsyncClient:
    """One connection pool for a whole run, with no cap beyond the run's own."""
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


async def run_workload(config: ClientConfig, specs: list[RequestSpec]) -> RunResult:
    """Send every spec at its arrival time; return one record per spec, in spec order."""
    records = [new_record(spec) for spec in specs]
    limiter = trio.CapacityLimiter(config.concurrency) if config.concurrency else None
    async with open_client(config) as client:
        started_unix = time.time()
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for spec, record in zip(specs, records, strict=True):
                nursery.start_soon(_run_one, client, config, spec, record, t0, limiter)
    return RunResult(records=records, started_unix=started_unix)
