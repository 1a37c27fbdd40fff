"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import math
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import orjson
import structlog
import trio
from quart import Blueprint, Response, current_app, request
from quart_trio import QuartTrio

from service.api.access import request_key
from service.api.app_state import AppState, app_state
from service.api.batch import merge_channels
from service.api.body import read_body
from service.api.chat_setup import (
    after_reasoning,
    check_tool_choice,
    forced_calls_format,
    keeps_special_tokens,
    output_reader,
    template_args,
)
from service.api.errors import APIError, bad_request, json_response
from service.api.lora_models import adapter_cards, adapter_of, with_adapter
from service.api.openai_answer import (
    abort,
    failure_of,
    stream_response,
    unavailable,
    whole_response,
)
from service.api.openai_logprobs import Echo
from service.api.openai_responses import (
    ResponseHeader,
)
from service.api.openai_schema import (
    GenerationRequest,
    PromptBound,
    parse_chat_request,
    parse_completion_request,
)
from service.config import ApiKey
from service.engine.adapters import Adapter
from service.engine.admission import Overloaded
from service.engine.engine import EngineUnavailable
from service.engine.grammar import GrammarUnavailable, InvalidGrammar, ResponseFormat
from service.engine.request import (
    DEFAULT_TENANT,
    SUB_TENANT_SEPARATOR,
    Event,
    SamplingParams,
    TokenEvent,
    account_of,
)
from service.engine.validation import InvalidRequest
from service.tokenizer import Tokenizer

log = structlog.get_logger("cadence.api")
blueprint = Blueprint("openai", __name__)
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
MAX_LOGGED_NAMES = 16  # unknown fields named in the log line (all are counted)
MAX_LOGGED_NAME_CHARS = 64


@blueprint.get("/health")
async def health() -> Response:
    engine = app_state().engine
    # The policy in force is public (the playground shows it); changing it needs the admin token.
    body: dict[str, Any] = {"policy": engine.policy_info()}
    failure = engine.last_worker_failure
    if failure is not None:  # why and when; its error text is for /admin/state only
        body["last_worker_failure"] = {"reason": failure["reason"], "at": failure["at"]}
    if engine.ready:
        return json_response({"status": "ok", **body}, 200)
    return json_response({"status": "unavailable", **body}, 503)


@blueprint.get("/version")
async def version() -> Response:
    """vLLM's: the server's version (this package's)."""
    return json_response({"version": server_version()}, 200)


def server_version() -> str:
    try:
        return importlib.metadata.version("cadence")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


@blueprint.get("/v1/models")
async def list_models() -> Response:
    state = app_state()
    max_model_len = state.engine.max_model_len
    card: dict[str, Any] = {
        "id": state.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "cadence",
    }
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return json_response({"object": "list", "data": [card, *adapter_cards(state)]}, 200)


@blueprint.post("/v1/completions")
async def completions() -> Response:
    body = await read_json_body()
    tenant = request.headers.get("X-Tenant")
    req = parse_completion_request(body, tenant, prompt_bound())
    return await (serve_batch(req) if req.batch else serve_generation(req))


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    body = await read_json_body()
    tenant = request.headers.get("X-Tenant")
    return await serve_generation(parse_chat_request(body, tenant, prompt_bound()))


def prompt_bound() -> PromptBound | None:
    state = app_state()
    max_model_len = state.engine.max_model_len
    if max_model_len is None:
        return None  # no worker yet: the request gets its 503 before any tokenizing
    return PromptBound(max_model_len, state.tokenizer.max_token_chars)


async def read_json_body() -> Any:
    data = await read_body()
    if not data:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def require_served_model(model: str | None, state: AppState) -> Adapter | None:
    """The LoRA adapter a request's `model` names (None: the served model); any other
    model is a 404, as OpenAI and vLLM answer it."""
    return adapter_of(model, state)


async def serve_generation(req: GenerationRequest) -> Response:
    state = app_state()
    await prepare(req, state)
    request_id = new_request_id(req)
    prompt_ids, channel = await submit_prompt(req, state, request_id)
    header = ResponseHeader(req.kind, request_id, req.params.adapter or state.served_model_name)
    echoes: list[Echo | None] | None = [echo_of(req, prompt_ids, state)] if req.echo else None
    return await respond(req, header, channel, state, echoes)


async def serve_batch(req: GenerationRequest) -> Response:
    """A list prompt, as vLLM serves it: one engine request per prompt, their sequences
    indexed across the prompts (prompt i's choice j is choice i x n + j)."""
    assert req.batch is not None
    state = app_state()
    await prepare(req, state)
    request_id = new_request_id(req)
    channels: list[trio.MemoryReceiveChannel] = []
    echoes: list[Echo | None] = []
    header = ResponseHeader(req.kind, request_id, req.params.adapter or state.served_model_name)
    try:
        for i, prompt in enumerate(req.batch):
            one = dataclasses.replace(req, prompt=prompt, params=dataclasses.replace(req.params))
            engine_id = f"{request_id}-{i}"
            prompt_ids, channel = await submit_prompt(one, state, engine_id)
            header.engine_ids += (engine_id,)
            channels.append(channel)
            echoes.append(echo_of(one, prompt_ids, state) if req.echo else None)
            req.prompt_tokens += one.prompt_tokens
    except BaseException:  # a prompt refused (or the client gone): the others end too
        abort_all(channels, header, state)
        raise
    # the app's lifespan nursery (quart-trio's): the forwarding outlives this handler's call
    nursery = cast(QuartTrio, current_app).nursery
    merged = merge_channels(channels, req.best_of, nursery)
    return await respond(req, header, merged, state, echoes if req.echo else None)


def abort_all(
    channels: list[trio.MemoryReceiveChannel], header: ResponseHeader, state: AppState
) -> None:
    for channel in channels:
        channel.close()
    abort(header, state)


async def prepare(req: GenerationRequest, state: AppState) -> None:
    """What every prompt of a request shares: the checks, the adapter, the grammar."""
    with_adapter(req.params, require_served_model(req.model, state))
    if not state.engine.ready:
        raise unavailable("the model worker is not ready yet; retry shortly")
    if req.chat is not None:
        check_tool_choice(req.chat, state.config)
        forced = forced_calls_format(req.chat)
        if forced is not None:  # as vLLM: the calls' grammar, whatever else the request says
            req.response_format = forced
    if req.response_format is not None:
        req.params.grammar = await grammar_of(req.response_format, state)


def new_request_id(req: GenerationRequest) -> str:
    return request_id_for("chatcmpl" if req.kind == "chat" else "cmpl", req.ignored)


def request_id_for(prefix: str, ignored: tuple[str, ...]) -> str:
    """A new request id; the request's `ignored` fields are logged with it."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    if ignored:
        # as vLLM: a field it does not know is no reason to refuse (routers add their own)
        log.warning(
            "request.fields_ignored",
            request_id=request_id,
            fields=loggable_names(ignored),
            count=len(ignored),
        )
    return request_id


async def submit_prompt(
    req: GenerationRequest, state: AppState, request_id: str
) -> tuple[list[int], trio.MemoryReceiveChannel]:
    """Tokenize the request's prompt and submit it: (its ids, its events)."""
    prompt_ids = await tokenize_prompt(req, state)
    req.prompt_tokens = len(prompt_ids)
    if req.chat is not None:
        req.reader = output_reader(req.chat, state.config, state.tokenizer, prompt_ids)
        if keeps_special_tokens(req.reader):
            req.params.skip_special_tokens = False
        grammar = after_reasoning(req.params.grammar, req.reader, req.chat, state.tokenizer)
        req.params.grammar = grammar
    check_logprob_volume(req, len(prompt_ids), state)
    tenant = tenant_of(req.tenant, request_key())
    params = isolated(req.params, tenant, state)
    if req.best_of > req.n and not params.sampling.logprobs:
        # the sequences are ranked by log-probability, which the worker then reports
        params = dataclasses.replace(
            params, sampling=dataclasses.replace(params.sampling, logprobs=True)
        )
    with engine_refusals(lambda param: field_of(param, req)):
        channel = await state.engine.submit(
            prompt_ids,
            params,
            request_id=request_id,
            tenant=tenant,
            priority=priority_of(req.priority, request_key()),
            deadline_s=deadline_of(req),
            n=req.best_of,
        )
    return prompt_ids, channel


@contextlib.contextmanager
def engine_refusals(field: Callable[[str | None], str | None]) -> Iterator[None]:
    """The engine's refusals of a submission as HTTP errors: 429, 503, or a 400 naming the
    request's `field` behind the engine argument at fault."""
    try:
        yield
    except Overloaded as exc:
        raise APIError(
            429,
            f"the server is overloaded ({exc}); retry later",
            code="overloaded",
            headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))},
        ) from None
    except EngineUnavailable as exc:
        raise unavailable(str(exc) or "the engine is not available") from None
    except InvalidRequest as exc:
        raise bad_request(str(exc), field(exc.param), exc.code) from None


def deadline_of(req: GenerationRequest) -> float | None:
    return None if req.deadline_ms is None else req.deadline_ms / 1000


async def respond(
    req: GenerationRequest,
    header: ResponseHeader,
    channel: trio.MemoryReceiveChannel,
    state: AppState,
    echoes: list[Echo | None] | None,
) -> Response:
    """`echoes`: each prompt's, when the request asked for it."""
    if not req.stream:
        return await whole_response(req, header, channel, state, echoes)
    first = await decided_start(req, channel, header, state)
    return stream_response(req, header, channel, state, first, echoes)


async def decided_start(
    req: GenerationRequest,
    channel: trio.MemoryReceiveChannel,
    header: ResponseHeader,
    state: AppState,
) -> list[Event]:
    """The events a stream starts with. A request that may miss its deadline is answered
    once it is decided: its first token (200, streamed) or its refusal (an HTTP error a
    client can retry on)."""
    if req.deadline_ms is None and state.config.max_queue_time is None:
        return []
    return await first_event(channel, header, state)


def field_of(param: str | None, req: GenerationRequest) -> str | None:
    """The request's field behind an engine argument the validation names."""
    if param == "n" and req.best_of > req.n:
        return "best_of"
    if param == "deadline_s":
        return "deadline_ms"
    if param in ("top_logprobs", "prompt_logprobs") and req.kind == "completion":
        return "logprobs"
    return param


def loggable_names(names: tuple[str, ...]) -> list[str]:
    """A client's field names as a log line may hold them: a few, each cut short (a body
    of 4 MiB can be one 4 MiB name, or 100,000 short ones)."""
    return [
        name if len(name) <= MAX_LOGGED_NAME_CHARS else name[:MAX_LOGGED_NAME_CHARS] + "..."
        for name in names[:MAX_LOGGED_NAMES]
    ]


def check_logprob_volume(req: GenerationRequest, prompt_len: int, state: AppState) -> None:
    """A 400 for a response whose log-probability entries exceed --max-logprob-entries."""
    sampling, limit = req.params.sampling, state.config.max_logprob_entries
    if not sampling.logprobs:
        return
    window = state.engine.max_model_len or prompt_len + 1
    max_tokens = req.params.max_tokens or max(1, window - prompt_len)
    tokens = max_tokens + (prompt_len if req.echo else 0)
    entries = req.n * (sampling.top_logprobs + 1) * tokens
    if entries > limit:
        param = "top_logprobs" if req.kind == "chat" and sampling.top_logprobs else "logprobs"
        raise bad_request(
            f"n ({req.n}) x (logprobs ({sampling.top_logprobs}) + 1) x tokens ({tokens}: "
            f"max_tokens{' + the echoed prompt' if req.echo else ''}) is {entries} "
            f"log-probability entries, more than this server's {limit}; ask for fewer",
            param,
            "logprobs_too_large",
        )


def tenant_of(claimed: str | None, key: ApiKey | None) -> str:
    """With API keys the key's tenant, a client's name only a sub-tenant inside it."""
    if key is None:
        return claimed or DEFAULT_TENANT
    return key.tenant if claimed is None else f"{key.tenant}{SUB_TENANT_SEPARATOR}{claimed}"


def priority_of(priority: int, key: ApiKey | None) -> int:
    """A client's `priority` is refused (403) from a key not allowed to set one: it would
    jump every other tenant's requests."""
    if key is not None and priority != 0 and not key.may_set_priority:
        raise APIError(
            403,
            "this API key may not set 'priority' (the operator grants it in --api-key-file)",
            param="priority",
            code="priority_not_allowed",
        )
    return priority


def isolated(params: SamplingParams, tenant: str, state: AppState) -> SamplingParams:
    """With --cache-isolation tenant, the tenant salts the prefix cache on the server's
    side; a client's own cache_salt narrows it further, never across tenants."""
    if not state.config.isolates_tenants():
        return params
    salt = "\0".join(["tenant", account_of(tenant), params.cache_salt or ""])
    return dataclasses.replace(params, cache_salt=salt)


def echo_of(req: GenerationRequest, prompt_ids: list[int], state: AppState) -> Echo:
    if isinstance(req.prompt, str):
        return Echo(req.prompt, prompt_ids)
    return Echo(state.tokenizer.decode(prompt_ids, skip_special_tokens=False), prompt_ids)


async def first_event(
    channel: trio.MemoryReceiveChannel, header: ResponseHeader, state: AppState
) -> list[Event]:
    """The request's first event; a failure before any token becomes the HTTP error."""
    try:
        event = await channel.receive()
    except trio.EndOfChannel:
        event = None
    except BaseException:  # the client went away (cancelled): free what it held
        channel.close()
        abort(header, state)
        raise
    if isinstance(event, TokenEvent):
        return [event]
    channel.close()
    error = failure_of(event)
    assert error is not None, "a request cannot finish well before its first token"
    raise error


async def tokenize_prompt(req: GenerationRequest, state: AppState) -> list[int]:
    if isinstance(req.prompt, list):
        return list(req.prompt)
    # Up to max_model_len x the longest token's characters (hundreds of KB): seconds of
    # tokenizer work that must not stop every other stream, so it runs in a thread.
    chat_args = {} if req.chat is None else template_args(req.chat, state.config)
    return await trio.to_thread.run_sync(
        prompt_ids_of, req, state.tokenizer, chat_args, limiter=state.tokenizer_threads
    )


def prompt_ids_of(
    req: GenerationRequest, tokenizer: Tokenizer, chat_args: dict[str, Any]
) -> list[int]:
    """Render and tokenize a text prompt or a chat (blocking: call it in a worker thread);
    `chat_args`: the chat template's arguments beyond the messages."""
    if req.kind == "completion":
        assert isinstance(req.prompt, str)
        return tokenizer.encode(req.prompt, add_special_tokens=True)
    assert req.messages is not None
    try:
        return tokenizer.encode_chat(req.messages, True, **chat_args)
    except Exception as exc:  # a template may reject a message order (e.g. two system turns)
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None


async def grammar_of(response_format: ResponseFormat, state: AppState) -> Any:
    """The compiled grammar, on the grammar threads, within GRAMMAR_COMPILE_TIMEOUT_S.

    xgrammar cannot be stopped mid-compilation: a request that hangs up or times out stops
    waiting at once (abandon_on_cancel) and its thread finishes on its own, holding its
    place on the limiter until then, and caches what it compiled for the next asker. The
    compiler's one-time set-up (the vocabulary's conversion) is waited for outside that
    time: on a busy machine it alone can take longer."""
    grammars = state.grammars
    if grammars is not None and not grammars.is_prepared:
        with contextlib.suppress(GrammarUnavailable):  # compile_grammar reports it
            await trio.to_thread.run_sync(
                grammars.prepare, limiter=state.grammar_threads, abandon_on_cancel=True
            )
    with trio.move_on_after(GRAMMAR_COMPILE_TIMEOUT_S):
        return await trio.to_thread.run_sync(
            compile_grammar,
            response_format,
            state,
            limiter=state.grammar_threads,
            abandon_on_cancel=True,
        )
    raise bad_request(
        f"compiling the {response_format.kind} of {response_format.param} took more than "
        f"{GRAMMAR_COMPILE_TIMEOUT_S} s (waiting included); simplify it or retry later",
        response_format.param,
        "grammar_timeout",
    )


def compile_grammar(response_format: ResponseFormat, state: AppState) -> Any:
    """The grammar of a request (its field is `response_format.param`: "tools" for the
    forced tool calls), from
    the cache or compiled (blocking: call it in a worker thread); a schema it cannot serve
    is a 400."""
    try:
        if state.grammars is None:
            raise GrammarUnavailable("structured output is not enabled on this server")
        return state.grammars.compile(response_format)
    except GrammarUnavailable as exc:
        raise bad_request(str(exc), response_format.param) from None
    except InvalidGrammar as exc:
        raise bad_request(
            f"the {response_format.kind} of {response_format.param} is not supported: {exc}",
            response_format.param,
        ) from None
