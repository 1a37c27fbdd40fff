"""Untrusted OpenAI-style request bodies -> typed records the routes hand to the engine.

This layer reads JSON: types, OpenAI's field names and their mapping onto the engine's
(max_completion_tokens, top_k -1, user as the tenant), fields the server does not support.
Every problem raises APIError(400) naming the offending field. Whether the values make a
servable request (ranges, lengths, the context window) is decided once, by the engine's
validation (service/engine/validation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gpu_worker.protocol import SamplingSpec
from service.api.chat_output import OutputReader
from service.api.errors import APIError, bad_request
from service.api.fields import Fields
from service.api.kv_transfer_params import kv_transfer_fields
from service.api.openai_chat import ChatOptions, parse_chat_options, parse_message
from service.api.openai_grammar import parse_grammar, structural_tag_format
from service.api.openai_sampling import params_fields, spec_fields
from service.engine.grammar import ResponseFormat
from service.engine.request import SamplingParams

MAX_BATCH_PROMPTS = 32  # prompts of one list `prompt` (completions)
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's `input` list
MAX_CACHE_SALT_CHARS = 256
MAX_SCHEMA_BYTES = 64 * 1024
# Each message is template and dict work: a chat of more messages than this (or than the
# window has tokens, since each costs at least one) is refused before any is read.
MAX_CHAT_MESSAGES = 4096  # response_format's JSON schema, serialized
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


@dataclass(frozen=True, slots=True)
class PromptBound:
    """The most a prompt can hold and still fit the context window, checked before anything
    costly: a token-id list by its length, a text by its characters (no token stands for
    more than `max_token_chars` of them), before any tokenizing."""

    max_tokens: int
    max_token_chars: int

    def check_tokens(self, count: int, param: str) -> None:
        if count > self.max_tokens:
            raise self._too_long(f"{count} tokens", param)

    def check_chars(self, count: int, param: str) -> None:
        if count > self.max_tokens * self.max_token_chars:
            raise self._too_long(f"{count} characters, more than that many tokens can hold", param)

    def _too_long(self, size: str, param: str) -> APIError:
        return bad_request(
            f"This model's maximum context length is {self.max_tokens} tokens. However, your "
            f"prompt has {size}. Please reduce the length of the prompt.",
            param,
            "context_length_exceeded",
        )


@dataclass(slots=True)
class GenerationRequest:
    """One completion or chat request, validated but not yet tokenized."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompt: str | list[int] | None  # completions (a list prompt's first)
    messages: list[dict[str, Any]] | None  # chat, content flattened to text
    params: SamplingParams  # max_tokens None: the rest of the context window (chat)
    stream: bool
    include_usage: bool
    tenant: str | None  # the client's name for it (`user`, X-Tenant); None: none given
    priority: int
    deadline_ms: float | None = None  # cadence's extension: how long it may wait to start
    echo: bool = False  # completions: the prompt comes back before the completion
    n: int = 1  # choices returned
    best_of: int = 1  # sequences generated; the n of highest log-probability are returned
    response_format: ResponseFormat | None = None  # None: free text
    chat: ChatOptions | None = None  # a chat's tools and template options
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    # set by the route once the prompt is tokenized
    prompt_tokens: int = 0
    reader: OutputReader | None = None  # a chat's answer read for reasoning and tool calls
    ignored: tuple[str, ...] = ()  # fields this server does not know, ignored (and logged)
    batch: list[str | list[int]] | None = None  # a list prompt of several (vLLM's batch)

    @property
    def sequences(self) -> int:
        """Sequences generated across every prompt."""
        return self.best_of * (len(self.batch) if self.batch else 1)


def parse_completion_request(
    body: Any, header_tenant: str | None, bound: PromptBound | None = None
) -> GenerationRequest:
    """`bound` None: the context window is not known yet (the worker is still starting)."""
    fields = Fields(body, _window(bound))
    prompts = _parse_prompts(fields.raw("prompt"), bound)
    logprobs = fields.integer("logprobs", None)
    echo = fields.boolean("echo", False)
    request = _parse_common(fields, "completion", header_tenant, logprobs)
    if request.params.max_tokens is None:
        request.params.max_tokens = 16  # OpenAI's default for completions
    request.prompt = prompts[0]
    request.batch = prompts if len(prompts) > 1 else None
    request.echo = echo
    if echo and logprobs is not None:
        request.params.sampling.prompt_logprobs = logprobs
    fields.check_leftovers()
    request.ignored = tuple(fields.ignored)
    return request


def parse_chat_request(
    body: Any, header_tenant: str | None, bound: PromptBound | None = None
) -> GenerationRequest:
    fields = Fields(body, _window(bound))
    messages = _parse_messages(fields.raw("messages"), bound)
    logprobs = fields.boolean("logprobs", False)
    top_logprobs = fields.integer("top_logprobs", 0) or 0
    if top_logprobs and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    request = _parse_common(fields, "chat", header_tenant, top_logprobs if logprobs else None)
    request.messages = messages
    request.chat = parse_chat_options(fields.raw)
    request.chat.thinking_budget = fields.integer("thinking_token_budget", None)
    fields.check_leftovers()
    request.ignored = tuple(fields.ignored)
    return request


@dataclass(slots=True)
class TokenizeRequest:
    """vLLM's POST /tokenize: a prompt, or a chat rendered by the model's template."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool
    chat: ChatOptions | None = None  # a chat's tools and template options, as generation's


def parse_tokenize_request(body: Any, bound: PromptBound | None = None) -> TokenizeRequest:
    fields = Fields(body)
    model = fields.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    prompt, messages = fields.raw("prompt"), fields.raw("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("send either 'prompt' or 'messages'", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt")
        if bound is not None:
            bound.check_chars(len(prompt), "prompt")
    chat = None
    if messages is not None:
        messages = _parse_messages(messages, bound)
        chat = parse_chat_options(fields.raw)
    return TokenizeRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        # vLLM's defaults: a prompt gets the tokenizer's special tokens, a chat its template's
        add_special_tokens=fields.boolean("add_special_tokens", prompt is not None),
        add_generation_prompt=fields.boolean("add_generation_prompt", True),
        return_token_strs=fields.boolean("return_token_strs", False),
        chat=chat,
    )


@dataclass(slots=True)
class EmbeddingRequest:
    """POST /v1/embeddings, as OpenAI and vLLM define it."""

    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str  # "float" | "base64" (little-endian float32)
    normalize: bool  # vLLM's: L2-normalized (its default), or the pooled state as is
    add_special_tokens: bool
    truncate_prompt_tokens: int | None  # vLLM's: keep only the last k tokens (-1: the window)
    tenant: str | None
    priority: int
    ignored: tuple[str, ...] = ()


def parse_embedding_request(
    body: Any, tenant_header: str | None, bound: PromptBound | None = None
) -> EmbeddingRequest:
    fields = Fields(body, _window(bound))
    model = fields.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    encoding_format = fields.raw("encoding_format") or "float"
    if encoding_format not in ("float", "base64"):
        raise bad_request(
            f"'encoding_format' must be 'float' or 'base64', got {encoding_format!r}",
            "encoding_format",
        )
    if fields.raw("dimensions") is not None:
        # vLLM's answer for a model without Matryoshka training: cutting its vectors short
        # would give poor embeddings
        raise bad_request(
            "this model does not support 'dimensions' (it has no Matryoshka representation)",
            "dimensions",
        )
    truncate = fields.integer("truncate_prompt_tokens", None)
    if truncate is not None and truncate != -1 and truncate < 1:
        raise bad_request(
            f"'truncate_prompt_tokens' must be -1 or at least 1, got {truncate}",
            "truncate_prompt_tokens",
        )
    # a prompt to be cut may be longer than the window (the body's size bounds it)
    inputs = _parse_prompts(
        fields.raw("input"), None if truncate else bound, "input", MAX_EMBEDDING_INPUTS
    )
    request = EmbeddingRequest(
        model=model,
        inputs=inputs,
        encoding_format=encoding_format,
        normalize=fields.boolean("normalize", True),
        add_special_tokens=fields.boolean("add_special_tokens", True),  # vLLM's default here
        truncate_prompt_tokens=truncate,
        tenant=_parse_tenant(tenant_header, fields.raw("user")),
        priority=fields.integer("priority", 0) or 0,
    )
    fields.check_leftovers()
    request.ignored = tuple(fields.ignored)
    return request


def parse_detokenize_request(
    body: Any, vocab_size: int, bound: PromptBound
) -> tuple[str | None, list[int]]:
    """vLLM's POST /detokenize: (model, token ids), at most a context window of them (its
    length is checked before any id is looked at)."""
    fields = Fields(body)
    model = fields.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    tokens = fields.raw("tokens")
    if isinstance(tokens, list):
        bound.check_tokens(len(tokens), "tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens
    ):
        raise bad_request(f"'tokens' must be a list of token ids in [0, {vocab_size})", "tokens")
    return model, tokens


def _window(bound: PromptBound | None) -> int | None:
    return None if bound is None else bound.max_tokens


def _parse_common(
    fields: Fields, kind: str, header_tenant: str | None, top_logprobs: int | None
) -> GenerationRequest:
    """`top_logprobs`: None, or the chosen tokens' log-probabilities with that many
    alternatives each."""
    model = fields.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    max_tokens = fields.integer("max_tokens", None)
    if kind == "chat":
        alternative = fields.integer("max_completion_tokens", None)
        max_tokens = alternative if alternative is not None else max_tokens
    n, best_of = _parse_sequences(fields)
    top_k = fields.integer("top_k", 0) or 0
    sampling = SamplingSpec(
        temperature=fields.number("temperature", 1.0),
        top_p=fields.number("top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's "disabled", the same as 0
        seed=fields.integer("seed", None),
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs or 0,
        **spec_fields(fields),
    )
    params = SamplingParams(
        max_tokens=max_tokens,
        stop=_parse_stop(fields.raw("stop")),
        ignore_eos=fields.boolean("ignore_eos", False),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        cache_salt=_parse_cache_salt(fields.raw("cache_salt")),
        sampling=sampling,
        **params_fields(fields),
        **kv_transfer_fields(fields.raw("kv_transfer_params")),
    )
    stream = fields.boolean("stream", False)
    if stream and best_of > n:
        raise bad_request("'best_of' greater than 'n' cannot be streamed", "best_of")
    if stream and params.remote_decode:  # the whole answer says where the K/V waits
        raise bad_request(
            "'kv_transfer_params' with do_remote_decode asks for a whole answer (stream false)",
            "kv_transfer_params",
        )
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=None,
        messages=None,
        params=params,
        stream=stream,
        include_usage=_parse_stream_options(fields.raw("stream_options"), stream),
        continuous_usage=_continuous_usage(fields.raw("stream_options")),
        tenant=_parse_tenant(header_tenant, fields.raw("user")),
        priority=fields.integer("priority", 0) or 0,
        deadline_ms=_parse_deadline(fields),
        n=n,
        best_of=best_of,
        response_format=parse_grammar(
            fields, _parse_response_format(fields.raw("response_format"))
        ),
    )


def _parse_sequences(fields: Fields) -> tuple[int, int]:
    """(n, best_of): best_of defaults to n and may not be less (both counts, bounded)."""
    n = fields.integer("n", 1)
    assert n is not None
    best_of = fields.integer("best_of", n)
    assert best_of is not None
    if best_of < n:
        raise bad_request(f"'best_of' must be at least 'n' ({n})", "best_of")
    return n, best_of


def _parse_cache_salt(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
    return value


def _parse_response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    param = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(
            f"'response_format' must be an object whose 'type' is one of "
            f"{list(RESPONSE_FORMAT_TYPES)}",
            param,
        )
    if kind == "structural_tag":
        return structural_tag_format(value)
    if kind != "json_schema":
        return None if kind == "text" else ResponseFormat("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request(
            "'response_format.json_schema' must be an object with a 'name' and a 'schema'", param
        )
    schema, strict = spec.get("schema"), spec.get("strict")
    if not isinstance(schema, dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema", param)
    if strict is not None and not isinstance(strict, bool):  # either way strict, as vLLM
        raise bad_request("'response_format.json_schema.strict' must be a boolean", param)
    try:
        text = orjson.dumps(schema)
    except orjson.JSONEncodeError:  # deeper than orjson writes (it reads deeper)
        message = "'response_format.json_schema.schema' is nested too deeply"
        raise bad_request(message, param) from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise bad_request(
            f"'response_format.json_schema.schema' is {len(text)} bytes serialized, "
            f"more than the {MAX_SCHEMA_BYTES} allowed",
            param,
        )
    return ResponseFormat("json_schema", text.decode())


def _parse_deadline(fields: Fields) -> float | None:
    """In milliseconds, as given (the engine bounds it)."""
    if fields.raw("deadline_ms") is None:
        return None
    return fields.number("deadline_ms", 0.0)


def _parse_prompts(
    value: Any, bound: PromptBound | None, param: str = "prompt", most: int = MAX_BATCH_PROMPTS
) -> list[str | list[int]]:
    """A prompt, or a list of them: strings or token-id lists."""
    if value is None:
        raise bad_request(f"'{param}' is required", param)
    if not (isinstance(value, list) and value and isinstance(value[0], str | list)):
        return [_parse_prompt(value, bound, param)]
    if len(value) > most:
        raise bad_request(f"'{param}' may list at most {most} prompts", param)
    return [_parse_prompt(one, bound, param) for one in value]


def _parse_prompt(value: Any, bound: PromptBound | None, param: str) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise bad_request(f"'{param}' must not be empty", param)
        if bound is not None:
            bound.check_chars(len(value), param)
        return value
    if isinstance(value, list):
        if not value:
            raise bad_request(f"'{param}' must not be empty", param)
        if bound is not None:
            bound.check_tokens(len(value), param)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise bad_request(
                f"'{param}' must be a string or a list of non-negative token ids", param
            )
        return value
    raise bad_request(f"'{param}' must be a string or a list of token ids", param)


def _parse_messages(value: Any, bound: PromptBound | None) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", "messages")
    limit = min(MAX_CHAT_MESSAGES, bound.max_tokens if bound is not None else MAX_CHAT_MESSAGES)
    if len(value) > limit:
        raise bad_request(
            f"a chat may have at most {limit} messages, this one has {len(value)}", "messages"
        )
    messages = [parse_message(i, message) for i, message in enumerate(value)]
    if bound is not None:
        # The template adds to the contents, so they alone bound the rendered prompt.
        bound.check_chars(sum(len(m["content"] or "") for m in messages), "messages")
    return messages


def _parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    return list(stops)


def _parse_stream_options(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", "stream_options")
    unknown = set(value) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise bad_request(f"unknown stream_options {sorted(unknown)}", "stream_options")
    for name in ("include_usage", "continuous_usage_stats"):
        if not isinstance(value.get(name, False), bool):
            raise bad_request(f"'stream_options.{name}' must be a boolean", "stream_options")
    return value.get("include_usage", False)


def _continuous_usage(value: Any) -> bool:
    """vLLM's continuous_usage_stats (read once _parse_stream_options has checked it)."""
    return isinstance(value, dict) and value.get("continuous_usage_stats", False)


def _parse_tenant(header: str | None, user: Any) -> str | None:
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    return header or user or None
