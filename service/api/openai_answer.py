"""A generation's answer, assembled from its engine requests' events: the whole JSON body
(completions and chat, `n` and `best_of` ranked) or the SSE stream (each choice's chunks,
the usage, [DONE]), and the errors a finished request is answered with. The routes
(service.api.routes_openai, routes_responses, routes_embeddings) submit; this answers."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Response

from service.api.app_state import AppState
from service.api.chat_output import MessageStream
from service.api.errors import APIError, json_response
from service.api.openai_logprobs import Echo, logprobs_of
from service.api.openai_responses import (
    Choice,
    ResponseHeader,
    delta_chunk,
    finish_reason_of,
    full_response,
    message_chunk,
    request_metrics,
    running_usage,
    usage,
    usage_chunk,
)
from service.api.openai_schema import GenerationRequest
from service.api.sse import DONE, HEARTBEAT, SSE_HEADERS, event_groups, sse_data
from service.engine.kv_transfer import KV_TRANSFER_FAILED
from service.engine.request import Event, FinishEvent, TokenEvent

SERVER_STATE_FAILURES = (
    "worker_died",
    "worker_hung",
    "worker_unavailable",
    "kv_capacity_exceeded",
    KV_TRANSFER_FAILED,  # the producer is gone or its hold expired: a router retries
)


def abort(header: ResponseHeader, state: AppState) -> None:
    """End the engine requests of a response (synchronous: safe in a cancelled scope)."""
    for engine_id in header.engine_ids or (header.request_id,):
        state.engine.abort(engine_id)


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="engine_unavailable", headers={"Retry-After": "1"})


def closed_early() -> APIError:
    return APIError(
        500, "the engine closed the request without finishing it", code="internal_error"
    )


def failure_of(finish: FinishEvent | None) -> APIError | None:
    """The error a finished (or vanished) request must be reported as, if any."""
    if finish is None:
        return closed_early()
    if finish.reason == "error":
        message = finish.error or finish.detail
        if finish.detail == "deadline_exceeded":
            # load shed, as a refusal at arrival is: the queue was too long for its deadline
            return APIError(
                429,
                f"{message}: the server is overloaded; retry later",
                code="deadline_exceeded",
                headers={"Retry-After": "1"},
            )
        if finish.detail == "slow_reader":
            return APIError(400, f"{message}; read the stream as it comes", code="slow_reader")
        if finish.detail in SERVER_STATE_FAILURES:
            # Not the request's fault and not a bug: the worker died, hung, cannot be
            # restarted, or came back too small for it. Retrying later may succeed.
            return APIError(
                503, f"{message}; retry later", code=finish.detail, headers={"Retry-After": "1"}
            )
        return APIError(500, f"generation failed: {message}", code="generation_error")
    if finish.reason == "abort":
        return unavailable(f"the request was aborted ({finish.detail})")
    return None


async def whole_response(
    req: GenerationRequest,
    header: ResponseHeader,
    channel: trio.MemoryReceiveChannel,
    state: AppState,
    echoes: list[Echo | None] | None,
) -> Response:
    body = await whole_body(req, header, channel, state, echoes)
    return json_response(body, 200, {"X-Request-Id": header.request_id})


async def whole_body(
    req: GenerationRequest,
    header: ResponseHeader,
    channel: trio.MemoryReceiveChannel,
    state: AppState,
    echoes: list[Echo | None] | None,
) -> dict[str, Any]:
    """The whole response's body, once every sequence has finished."""
    tokens: dict[int, list[TokenEvent]] = {i: [] for i in range(req.sequences)}
    finishes: dict[int, FinishEvent] = {}
    try:
        async for event in channel:
            if isinstance(event, TokenEvent):
                tokens[event.index].append(event)
                continue
            finishes[event.index] = event
            if failure_of(event) is not None:
                break  # the request has failed: the other sequences are aborted
    finally:
        # Runs on client disconnect too (trio.Cancelled): synchronous, so safe in a
        # cancelled scope; a no-op for a request that already finished.
        channel.close()
        if len(finishes) < req.sequences:
            abort(header, state)
    error = next((e for e in map(failure_of, finishes.values()) if e is not None), None)
    if error is None and len(finishes) < req.sequences:
        error = closed_early()
    if error is not None:
        raise error
    choices = []
    for i in ranked_sequences(tokens, req.n, req.best_of):
        echo = echoes[i // req.best_of] if echoes else None
        text = (echo.text if echo else "") + "".join(event.text for event in tokens[i])
        logprobs = logprobs_of(req, state.tokenizer.pieces, tokens[i], 0, echo)
        choices.append(answer(req, text, finishes[i].reason, logprobs))
    ordered = [finishes[i] for i in range(req.sequences)]
    usage_ = usage(ordered, state.config.reports_cached_tokens(), req.best_of)
    body = full_response(header, choices, usage_)
    if ordered[0].kv_transfer_params is not None:  # a producer's: where its K/V waits
        body["kv_transfer_params"] = ordered[0].kv_transfer_params
    return with_metrics(body, ordered, state)


def with_metrics(body: dict[str, Any], finishes: list[FinishEvent], state: AppState) -> dict:
    """A body that carries usage, with vLLM's per-request `metrics` where the server is
    asked for them (--enable-per-request-metrics)."""
    if state.config.enable_per_request_metrics:
        body["metrics"] = request_metrics(finishes)
    return body


def answer(req: GenerationRequest, text: str, reason: str, logprobs: Any) -> Choice:
    """One returned sequence, its message read by the request's reader if it has one."""
    if req.reader is None:
        return Choice(text, reason, logprobs)
    message = req.reader.message(text)
    return Choice(text, finish_reason_of(reason, "tool_calls" in message), logprobs, message)


def ranked_sequences(tokens: dict[int, list[TokenEvent]], n: int, best_of: int) -> list[int]:
    """The sequences returned, prompt by prompt (each has `best_of`): all of them, or with
    `best_of` the n of highest cumulative log-probability, best first."""
    if best_of == n:
        return sorted(tokens)

    def cumulative(index: int) -> float:
        return sum(sum(e.logprobs.logprobs) for e in tokens[index] if e.logprobs is not None)

    ranked: list[int] = []
    for start in range(0, len(tokens), best_of):
        prompts = range(start, start + best_of)
        ranked += sorted(prompts, key=cumulative, reverse=True)[:n]
    return ranked


def stream_response(
    req: GenerationRequest,
    header: ResponseHeader,
    channel: trio.MemoryReceiveChannel,
    state: AppState,
    first: list[Event],
    echoes: list[Echo | None] | None,
) -> Response:
    response = Response(
        sse_stream(req, header, channel, state, first, echoes),
        200,
        {**SSE_HEADERS, "X-Request-Id": header.request_id},
    )
    response.timeout = None  # a long generation must not be cut at RESPONSE_TIMEOUT
    return response


async def sse_stream(
    req: GenerationRequest,
    header: ResponseHeader,
    channel: trio.MemoryReceiveChannel,
    state: AppState,
    first: list[Event],
    echoes: list[Echo | None] | None,
) -> AsyncIterator[bytes]:
    """Each of the n sequences' chunks carries its `index` (best_of is never streamed).

    `first`: events already read from the channel (a request with a deadline); `echoes`:
    each prompt's echo, sent with its sequences' first tokens."""
    finishes: dict[int, FinishEvent] = {}
    failed = False
    choices = StreamedChoice.all_of(req, echoes)

    def data(chunk: dict[str, Any], choice: StreamedChoice) -> bytes:
        if req.continuous_usage:
            chunk["usage"] = running_usage(req.prompt_tokens, choice.counted)
        return sse_data(chunk)

    try:
        if req.kind == "chat":
            for choice in choices:
                yield data(delta_chunk(header, "", None, role=True, index=choice.index), choice)
        async for group in event_groups(channel, state.heartbeat_seconds, first, len(choices)):
            if not group:
                yield HEARTBEAT
                continue
            for index, events in by_index(group).items():
                choice = choices[index]
                chunk = tokens_chunk(req, header, state, choice, events)
                if chunk is not None:
                    yield data(chunk, choice)
                finish = events[-1]
                if not isinstance(finish, FinishEvent):
                    continue
                finishes[index] = finish
                error = failure_of(finish)
                if error is not None:  # the request has failed: the others are aborted
                    failed = True
                    yield sse_data(error.body())
                    yield DONE
                    return
                for chunk in finish_chunks(header, choice, finish.reason):
                    yield data(chunk, choice)
        for ending in stream_ending(req, header, state, finishes, len(choices)):
            yield ending
    finally:
        # Reached by trio.Cancelled (hypercorn reported the disconnect) or GeneratorExit
        # (a write failed): both in a cancelled context, so only synchronous cleanup here.
        channel.close()
        if failed or len(finishes) < len(choices):
            abort(header, state)


def stream_ending(
    req: GenerationRequest,
    header: ResponseHeader,
    state: AppState,
    finishes: dict[int, FinishEvent],
    choices: int,
) -> list[bytes]:
    """The events after the last choice's: an error if one never finished, the usage if
    asked for, then [DONE]."""
    if len(finishes) < choices:
        return [sse_data(closed_early().body()), DONE]
    if not req.include_usage:
        return [DONE]
    report_cached = state.config.reports_cached_tokens()
    ordered = [finishes[i] for i in range(choices)]
    usage_ = usage(ordered, report_cached, req.n)
    return [sse_data(with_metrics(usage_chunk(header, usage_), ordered, state)), DONE]


@dataclasses.dataclass(slots=True)
class StreamedChoice:
    """One choice's progress through a stream."""

    index: int
    echo: Echo | None  # the prompt, still to be sent with the first tokens
    stream: MessageStream | None  # a chat whose answer is read (tool calls, reasoning)
    text_offset: int = 0  # characters sent (completions' logprobs text_offset)
    counted: int = 0  # tokens sent (continuous_usage_stats)

    @classmethod
    def all_of(
        cls, req: GenerationRequest, echoes: list[Echo | None] | None
    ) -> list[StreamedChoice]:
        """A request's choices: best_of is never streamed, so one sequence a choice."""
        return [
            cls(
                i,
                echoes[i // req.n] if echoes else None,
                MessageStream(req.reader) if req.reader else None,
            )
            for i in range(req.sequences)
        ]


def tokens_chunk(
    req: GenerationRequest,
    header: ResponseHeader,
    state: AppState,
    choice: StreamedChoice,
    events: list[Event],
) -> dict[str, Any] | None:
    """The chunk of a choice's new tokens (None: nothing to send yet)."""
    tokens = [event for event in events if isinstance(event, TokenEvent)]
    choice.counted += sum(len(event.token_ids) for event in tokens)
    if choice.stream is not None:
        chunk = read_chunk(req, header, tokens, state, choice.stream, choice.index)
    else:
        chunk = token_chunk(
            req, header, tokens, state, choice.text_offset, choice.echo, choice.index
        )
    if chunk is not None:
        choice.text_offset += sum(len(event.text) for event in tokens)
        if choice.echo is not None:
            choice.text_offset += len(choice.echo.text)
            choice.echo = None
    return chunk


def finish_chunks(header: ResponseHeader, choice: StreamedChoice, reason: str) -> list[dict]:
    """A finished choice's last chunks: what its reader held back, then the reason."""
    chunks = []
    if choice.stream is not None:
        last = choice.stream.delta("", final=True)
        if last:
            chunks.append(message_chunk(header, last, None, choice.index))
        reason = finish_reason_of(reason, choice.stream.called)
    chunks.append(delta_chunk(header, None, reason, index=choice.index))
    return chunks


def by_index(group: list[Event]) -> dict[int, list[Event]]:
    """A group's events by sequence, in order (a sequence's FinishEvent ends its list)."""
    split: dict[int, list[Event]] = {}
    for event in group:
        split.setdefault(event.index, []).append(event)
    return split


def read_chunk(
    req: GenerationRequest,
    header: ResponseHeader,
    tokens: list[TokenEvent],
    state: AppState,
    stream: MessageStream,
    index: int,
) -> dict[str, Any] | None:
    """A chat chunk of what the new tokens add to the read answer (None: nothing yet)."""
    if not tokens:
        return None
    delta = stream.delta("".join(event.text for event in tokens))
    logprobs = None
    if req.params.sampling.logprobs:
        logprobs = logprobs_of(req, state.tokenizer.pieces, tokens, 0, None)
    if not delta and logprobs is None:
        return None
    return message_chunk(header, delta, logprobs, index)


def token_chunk(
    req: GenerationRequest,
    header: ResponseHeader,
    tokens: list[TokenEvent],
    state: AppState,
    text_offset: int,
    echo: Echo | None,
    index: int,
) -> dict[str, Any] | None:
    text = "".join(event.text for event in tokens)
    if not tokens or (not text and not req.params.sampling.logprobs and echo is None):
        return None  # nothing a client could see (e.g. half a UTF-8 character held back)
    logprobs = logprobs_of(req, state.tokenizer.pieces, tokens, text_offset, echo)
    if echo is not None:
        text = echo.text + text
    return delta_chunk(header, text, None, logprobs, index=index)
