"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served as the
chat request it amounts to (service.api.anthropic_input) on the chat's one engine path,
answered as Anthropic's message, whole or as its stream's events
(service.api.anthropic_output). Its errors are Anthropic's (service.api.anthropic_errors)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import trio
from quart import Blueprint, Response, request

from service.api.anthropic_errors import anthropic_error_body
from service.api.anthropic_input import ANTHROPIC_FIELDS, MessagesRequest, messages_request
from service.api.anthropic_output import (
    MessageEvents,
    content_of,
    message_object,
    stop_fields,
    usage_of,
)
from service.api.app_state import AppState, app_state
from service.api.chat_output import MessageStream, OutputReader
from service.api.errors import APIError, bad_request, json_response, params_renamed
from service.api.openai_answer import abort, closed_early, failure_of, whole_body
from service.api.openai_responses import ResponseHeader, finish_reason_of
from service.api.openai_schema import GenerationRequest, parse_chat_request
from service.api.routes_openai import (
    decided_start,
    prepare,
    prompt_bound,
    read_json_body,
    require_served_model,
    submit_prompt,
    tokenize_prompt,
)
from service.api.sse import SSE_HEADERS, event_groups
from service.engine.request import Event, FinishEvent, TokenEvent

blueprint = Blueprint("anthropic", __name__)


@blueprint.post("/v1/messages")
async def messages() -> Response:
    asked = messages_request(await read_json_body())
    state = app_state()
    header = ResponseHeader("chat", f"msg_{uuid.uuid4().hex}", state.served_model_name)
    with params_renamed(ANTHROPIC_FIELDS):
        req = chat_request(asked, state)
        await prepare(req, state)
        _, channel = await submit_prompt(req, state, header.request_id)
    if req.stream:
        first = await decided_start(req, channel, header, state)
        response = Response(
            event_stream(req, header, channel, state, first),
            200,
            {**SSE_HEADERS, "X-Request-Id": header.request_id},
        )
        response.timeout = None  # a long generation must not be cut at RESPONSE_TIMEOUT
        return response
    chat_body = await whole_body(req, header, channel, state, None)
    choice, usage = chat_body["choices"][0], chat_body["usage"]
    message = message_object(
        header,
        content_of(choice["message"]),
        usage_of(usage["prompt_tokens"], usage["completion_tokens"]),
    )
    message.update(stop_fields(choice["finish_reason"], choice["stop_reason"]))
    return json_response(message, 200, {"X-Request-Id": header.request_id})


@blueprint.post("/v1/messages/count_tokens")
async def count_tokens() -> Response:
    """The prompt's tokens, as the same body sent to /v1/messages would run it."""
    asked = messages_request(await read_json_body(), counting=True)
    state = app_state()
    with params_renamed(ANTHROPIC_FIELDS):
        req = chat_request(asked, state)
        require_served_model(req.model, state)
        prompt_ids = await tokenize_prompt(req, state)
    return json_response({"input_tokens": len(prompt_ids)})


def chat_request(asked: MessagesRequest, state: AppState) -> GenerationRequest:
    if asked.thinking and state.config.reasoning_parser is None:
        raise bad_request(
            "thinking needs a model this server reads reasoning from (--reasoning-parser)",
            "thinking",
        )
    return parse_chat_request(asked.chat, request.headers.get("X-Tenant"), prompt_bound())


def sse_event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


PING = sse_event({"type": "ping"})


async def event_stream(
    req: GenerationRequest,
    header: ResponseHeader,
    channel: trio.MemoryReceiveChannel,
    state: AppState,
    first: list[Event],
) -> AsyncIterator[bytes]:
    """`first`: events already read from the channel (a request with a deadline)."""
    events = MessageEvents(header)
    stream = MessageStream(req.reader or OutputReader())
    finished = False
    try:
        for event in events.started(req.prompt_tokens):
            yield sse_event(event)
        async for group in event_groups(channel, state.heartbeat_seconds, first):
            if not group:
                yield PING
                continue
            text = "".join(e.text for e in group if isinstance(e, TokenEvent))
            for event in events.deltas(stream.delta(text) if text else {}):
                yield sse_event(event)
            finish = group[-1]
            if isinstance(finish, FinishEvent):
                finished = True
                for event in closing_events(events, stream, finish):
                    yield sse_event(event)
                return
        finished = True
        yield error_event(closed_early())
    finally:
        # as the chat stream's: synchronous cleanup, safe in a cancelled scope
        channel.close()
        if not finished:
            abort(header, state)


def closing_events(
    events: MessageEvents, stream: MessageStream, finish: FinishEvent
) -> list[dict[str, Any]]:
    error = failure_of(finish)
    if error is not None:
        return [anthropic_error_body(error.message, error.status)]
    last = events.deltas(stream.delta("", final=True))
    return last + events.finished(finish, finish_reason_of(finish.reason, stream.called))


def error_event(error: APIError) -> bytes:
    return sse_event(anthropic_error_body(error.message, error.status))
