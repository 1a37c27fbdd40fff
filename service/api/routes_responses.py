"""POST /v1/responses: OpenAI's Responses API, stateless, served as the chat request it
amounts to (service.api.responses_input), answered as Responses output items, whole or as
the stream's typed events (service.api.responses_output)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import trio
from quart import Blueprint, Response, request

from service.api.app_state import AppState, app_state
from service.api.chat_output import MessageStream, OutputReader
from service.api.errors import json_response
from service.api.openai_answer import abort, closed_early, failure_of, whole_body, with_metrics
from service.api.openai_logprobs import logprobs_of
from service.api.openai_responses import ResponseHeader, finish_reason_of, usage
from service.api.openai_schema import GenerationRequest, parse_chat_request
from service.api.responses_input import chat_body_of, responses_fields
from service.api.responses_output import ResponseEvents, output_of, response_object
from service.api.routes_openai import prepare, prompt_bound, read_json_body, submit_prompt
from service.api.sse import HEARTBEAT, SSE_HEADERS, event_groups
from service.engine.request import FinishEvent, TokenEvent

blueprint = Blueprint("responses", __name__)


@blueprint.post("/v1/responses")
async def responses() -> Response:
    body = await read_json_body()
    chat = chat_body_of(body)
    state = app_state()
    header = ResponseHeader("chat", f"resp_{uuid.uuid4().hex}", state.served_model_name)
    with responses_fields():
        req = parse_chat_request(chat, request.headers.get("X-Tenant"), prompt_bound())
        await prepare(req, state)
        _, channel = await submit_prompt(req, state, header.request_id)
    if req.stream:
        response = Response(
            event_stream(req, header, channel, state, body),
            200,
            {**SSE_HEADERS, "X-Request-Id": header.request_id},
        )
        response.timeout = None  # a long generation must not be cut at RESPONSE_TIMEOUT
        return response
    chat_body = await whole_body(req, header, channel, state, None)
    choice = chat_body["choices"][0]
    output = output_of(choice["message"], (choice["logprobs"] or {}).get("content"))
    answer = response_object(header, body, output, choice["finish_reason"], chat_body["usage"])
    if "metrics" in chat_body:  # --enable-per-request-metrics
        answer["metrics"] = chat_body["metrics"]
    return json_response(answer, 200, {"X-Request-Id": header.request_id})


def sse_event(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def event_stream(
    req: GenerationRequest,
    header: ResponseHeader,
    channel: trio.MemoryReceiveChannel,
    state: AppState,
    body: dict[str, Any],
) -> AsyncIterator[bytes]:
    events = ResponseEvents(header, body)
    stream = MessageStream(req.reader or OutputReader())
    finished = False
    try:
        for event in events.started():
            yield sse_event(event)
        async for group in event_groups(channel, state.heartbeat_seconds):
            if not group:
                yield HEARTBEAT
                continue
            tokens = [e for e in group if isinstance(e, TokenEvent)]
            text = "".join(e.text for e in tokens)
            logprobs = logprobs_of(req, state.tokenizer.pieces, tokens, 0, None)
            delta = stream.delta(text) if text else {}
            for event in events.deltas(delta, (logprobs or {}).get("content") or []):
                yield sse_event(event)
            finish = group[-1]
            if isinstance(finish, FinishEvent):
                finished = True
                for event in closing_events(events, stream, finish, state):
                    yield sse_event(event)
                return
        finished = True
        yield sse_event(events.event("error", **error_fields(closed_early().body())))
    finally:
        # as the chat stream's: synchronous cleanup, safe in a cancelled scope
        channel.close()
        if not finished:
            abort(header, state)


def closing_events(
    events: ResponseEvents, stream: MessageStream, finish: FinishEvent, state: AppState
) -> list[dict[str, Any]]:
    error = failure_of(finish)
    if error is not None:
        return [events.event("error", **error_fields(error.body()))]
    last = events.deltas(stream.delta("", final=True), [])
    reason = finish_reason_of(finish.reason, stream.called)
    done = events.finished(reason, usage([finish], state.config.reports_cached_tokens(), 1))
    with_metrics(done[-1]["response"], [finish], state)  # in the final response, as vLLM's
    return last + done


def error_fields(body: dict[str, Any]) -> dict[str, Any]:
    error = body["error"]
    return {"message": error["message"], "code": error.get("code"), "param": error.get("param")}
