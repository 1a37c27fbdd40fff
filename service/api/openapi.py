"""The server's OpenAPI 3.1 description, served at GET /openapi.json.

Clients and code generators read it; tests/test_api_fuzz.py hands it to schemathesis, which
fuzzes every route from it. So it states the limits the server really enforces: the context
window of the running model, the engine's validation bounds, each policy's parameter ranges.
A field the server accepts but the document omits would never be fuzzed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from quart import Blueprint, Response

from policies.registry import POLICIES
from service.api.access import METRICS_PATH, needs_key
from service.api.anthropic_errors import answers_anthropic
from service.api.anthropic_input import CHAT_ONLY as ANTHROPIC_CHAT_ONLY
from service.api.anthropic_input import EFFORTS, THINKING_DISPLAYS, THINKING_TYPES
from service.api.anthropic_input import NEUTRAL as ANTHROPIC_NEUTRAL
from service.api.app_state import app_state
from service.api.counts import count_schema
from service.api.errors import json_response
from service.api.fields import NEUTRAL_VALUES
from service.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.api.openai_chat import CHAT_ROLES, REASONING_EFFORTS, TOOL_CHOICES
from service.api.openai_schema import (
    MAX_BATCH_PROMPTS,
    MAX_CACHE_SALT_CHARS,
    MAX_CHAT_MESSAGES,
    MAX_EMBEDDING_INPUTS,
    MAX_SCHEMA_BYTES,
)
from service.api.responses_input import CHAT_ONLY
from service.api.responses_options import LOGPROBS_INCLUDE, NEUTRAL, SUMMARIES
from service.engine.validation import (
    MAX_BAD_WORDS,
    MAX_DEADLINE_S,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_SEQUENCES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TENANT_CHARS,
)

blueprint = Blueprint("openapi", __name__)
Schema = dict[str, Any]
JSON = "application/json"
SSE = "text/event-stream"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


@blueprint.get("/openapi.json")
async def openapi_json() -> Response:
    state = app_state()
    document = openapi_document(
        state.engine.max_model_len, state.served_model_name, bool(state.config.api_keys)
    )
    return json_response(document)


def openapi_document(max_model_len: int | None, model_name: str, api_keys: bool = False) -> Schema:
    """The description of every route; `max_model_len` None: the worker is not ready yet;
    `api_keys`: the routes that want a key say so (as the server then enforces)."""
    public = _public_paths(max_model_len)
    if api_keys:
        public = {path: _keyed(path, operations) for path, operations in public.items()}
    return {
        "openapi": "3.1.0",
        "info": {"title": "cadence", "version": "1", "description": f"Serving {model_name}."},
        "paths": {**public, **_admin_paths()},
        "components": {
            "schemas": {"Error": _error_schema(), "AnthropicError": _anthropic_error_schema()},
            "securitySchemes": {
                "admin": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "http", "scheme": "bearer"},
            },
        },
    }


def _keyed(path: str, operations: Schema) -> Schema:
    """An operation behind the API key: its scheme, its 401, and the 403 of a generation's
    `priority` the key may not set, or of /metrics to a key not granted it."""
    if not needs_key(path):
        return operations
    errors = _anthropic_errors if answers_anthropic(path) else _errors
    for operation in operations.values():
        operation["security"] = [{"apiKey": []}]
        operation["responses"].update(errors(401))
        if path in GENERATION_PATHS or path == METRICS_PATH or answers_anthropic(path):
            operation["responses"].update(errors(403))
    return operations


# ---- /v1 and the public routes ------------------------------------------------------------


def _public_paths(max_model_len: int | None) -> Schema:
    return {
        "/v1/completions": {
            "post": _generation("Create a completion", _completion_request(max_model_len))
        },
        "/v1/chat/completions": {
            "post": _generation("Create a chat completion", _chat_request(max_model_len))
        },
        "/v1/models": {"get": _get("The model served", _models_schema())},
        "/version": {
            "get": _get("The server's version", _open({"version": {"type": "string"}}, ["version"]))
        },
        "/tokenize": {"post": _tokenize()},
        "/v1/responses": {"post": _responses(max_model_len)},
        "/v1/messages": {"post": _messages(max_model_len)},
        "/v1/messages/count_tokens": {"post": _count_tokens(max_model_len)},
        "/v1/embeddings": {"post": _embeddings(max_model_len)},
        "/detokenize": {"post": _detokenize()},
        "/health": {
            "get": {
                "summary": "200 when the worker is ready, 503 while it starts or restarts",
                "responses": {
                    "200": _json_content("Ready", _health_schema()),
                    "503": _json_content("Not ready", _health_schema()),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {"200": _content("Metrics", METRICS_CONTENT_TYPE, {"type": "string"})},
            }
        },
        "/openapi.json": {"get": _get("This document", {"type": "object"})},
        "/": {
            "get": {
                "summary": "The playground page",
                "responses": {"200": _content("HTML", "text/html", {"type": "string"})},
            }
        },
    }


def _tokenize() -> Schema:
    """vLLM's: a prompt, or a chat through the model's template."""
    flags = {
        "model": {"type": ["string", "null"]},
        "add_special_tokens": {"type": ["boolean", "null"]},
        "return_token_strs": {"type": ["boolean", "null"]},
    }
    prompt = {**flags, "prompt": {"type": "string"}}
    chat = {
        **flags,
        "messages": _chat_request(None)["properties"]["messages"],
        "add_generation_prompt": {"type": ["boolean", "null"]},
        **_tool_fields(),
    }
    request = {"oneOf": [_open(prompt, ["prompt"]), _open(chat, ["messages"])]}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    response = _object_open(
        {
            "count": {"type": "integer", "minimum": 0},
            "max_model_len": {"type": ["integer", "null"]},
            "tokens": ids,
            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
        }
    )
    return _post("Tokenize a prompt or a chat (vLLM's endpoint)", request, response)


def _detokenize() -> Schema:
    request = _open(
        {
            "model": {"type": ["string", "null"]},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
        ["tokens"],
    )
    response = _object_open({"prompt": {"type": "string"}})
    return _post("Token ids back to text (vLLM's endpoint)", request, response)


def _post(summary: str, request: Schema, response: Schema) -> Schema:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
        "responses": {"200": _json_content(summary, response), **_errors(400, 404, 413, 415, 503)},
    }


def _open(properties: Schema, required: list[str]) -> Schema:
    """An object with these fields; others are ignored, as vLLM does."""
    return {"type": "object", "properties": properties, "required": required}


def _generation(summary: str, request_schema: Schema) -> Schema:
    return {
        "summary": summary,
        "parameters": [
            {"name": "X-Tenant", "in": "header", "required": False, "schema": {"type": "string"}}
        ],
        "requestBody": {"required": True, "content": {JSON: {"schema": request_schema}}},
        "responses": {
            "200": {
                "description": "The whole response, or with stream=true server-sent events",
                "content": {JSON: {"schema": _completion_response()}, SSE: {"schema": {}}},
            },
            **_errors(400, 404, 413, 415, 429, 503),
        },
    }


def _responses(max_model_len: int | None) -> Schema:
    """OpenAI's Responses API, stateless (served as the chat it amounts to): its own fields,
    and the chat's sampling fields but those with a Responses name or no Responses place."""
    shared = _request({}, [], max_model_len)["properties"]
    chat = {**shared, **_tool_fields()}
    for name in (*CHAT_ONLY, "tools", "tool_choice"):
        chat.pop(name, None)
    item = {"type": "object"}
    own = {
        "input": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_CHAT_MESSAGES},
            ]
        },
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": count_schema("max_output_tokens", max_model_len),
        "top_logprobs": count_schema("top_logprobs", max_model_len),
        "tools": {"type": ["array", "null"], "items": item},
        "tool_choice": {"oneOf": [{"type": "null"}, {"enum": list(TOOL_CHOICES)}, item]},
        "text": _text_format(),
        "reasoning": {
            "oneOf": [
                {"type": "null"},
                _open(
                    {
                        "effort": {"oneOf": [{"type": "null"}, {"enum": list(REASONING_EFFORTS)}]},
                        "summary": {"enum": list(SUMMARIES)},
                    },
                    [],
                ),
            ]
        },
        "include": {"type": ["array", "null"], "items": {"const": LOGPROBS_INCLUDE}},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        "safety_identifier": {"type": ["string", "null"], "maxLength": MAX_TENANT_CHARS},
        **{name: {"enum": _distinct(values)} for name, (values, _) in NEUTRAL.items()},
    }
    request = _open({**chat, **own}, ["input"])
    request["additionalProperties"] = True  # as the chat's: unknown fields are logged
    operation = _generation(
        "A response: input text or items (messages, function_call, function_call_output), "
        "instructions and function tools; stream=true: its typed events",
        request,
    )
    operation["responses"]["200"]["content"][JSON]["schema"] = {"type": "object"}
    return operation


def _messages(max_model_len: int | None) -> Schema:
    """Anthropic's Messages API (served as the chat it amounts to): its own fields, and the
    chat's sampling fields but those with a Messages name; its errors are Anthropic's."""
    shared = _request({}, [], max_model_len)["properties"]
    for name in (*ANTHROPIC_CHAT_ONLY, "tools", "tool_choice", "metadata", "service_tier"):
        shared.pop(name, None)
    own = {
        **_messages_prompt(max_model_len),
        "model": {"type": "string"},
        "max_tokens": count_schema("max_tokens", max_model_len),
        "stop_sequences": {
            "type": ["array", "null"],
            "items": {"type": "string", "minLength": 1},
            "maxItems": MAX_STOP_STRINGS,
        },
        "metadata": {
            "oneOf": [
                {"type": "null"},
                _object({"user_id": {"type": ["string", "null"]}}, []),
            ],
            "description": "user_id: the tenant hint, as the chat's `user`",
        },
    }
    request = _open({**shared, **own}, ["model", "max_tokens", "messages"])
    request["additionalProperties"] = True  # as the chat's: unknown fields are logged
    summary = "A message (Anthropic's Messages API); stream=true: its events"
    return _anthropic_operation(summary, request, _open(_MESSAGE_FIELDS, list(_MESSAGE_FIELDS)))


def _count_tokens(max_model_len: int | None) -> Schema:
    request = _object({"model": {"type": "string"}, **_messages_prompt(max_model_len)}, [])
    request["required"] = ["model", "messages"]
    counted = _object({"input_tokens": {"type": "integer", "minimum": 0}}, ["input_tokens"])
    summary = "The prompt's tokens, as /v1/messages runs it"
    return _anthropic_operation(summary, request, counted, streams=False)


def _messages_prompt(max_model_len: int | None) -> Schema:
    """What a Messages prompt is made of: the fields count_tokens takes too."""
    text = _open({"type": {"const": "text"}, "text": {"type": "string"}}, ["type", "text"])
    call = _open(
        {
            "type": {"const": "tool_use"},
            "id": {"type": "string"},
            "name": {"type": "string"},
            "input": {"type": "object"},
        },
        ["type", "id", "name", "input"],
    )
    result = _open(
        {
            "type": {"const": "tool_result"},
            "tool_use_id": {"type": "string"},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text}]},
            "is_error": {"type": "boolean"},
        },
        ["type", "tool_use_id"],
    )
    thought = _open({"type": {"const": "thinking"}, "thinking": {"type": "string"}}, ["type"])
    block = {"oneOf": [text, call, result, thought]}  # text to the model, no images
    content = {"oneOf": [{"type": "string"}, {"type": "array", "items": block}]}
    message = _open({"role": {"enum": ["user", "assistant"]}, "content": content}, ["role"])
    tool = _open(
        {"name": {"type": "string", "minLength": 1}, "input_schema": {"type": "object"}},
        ["name", "input_schema"],
    )
    choice = _open({"type": {"enum": ["auto", "any", "tool", "none"]}}, ["type"])
    thinking = _open(
        {"type": {"enum": list(THINKING_TYPES)}, "display": {"enum": list(THINKING_DISPLAYS)}},
        ["type"],
    )
    return {
        "system": {
            "oneOf": [{"type": "null"}, {"type": "string"}, {"type": "array", "items": text}]
        },
        "messages": {
            "type": "array",
            "items": message,
            "minItems": 1,
            "maxItems": MAX_CHAT_MESSAGES,
        },
        "tools": {"type": ["array", "null"], "items": tool},
        "tool_choice": {"oneOf": [{"type": "null"}, choice]},
        "thinking": {"oneOf": [{"type": "null"}, thinking]},
        "cache_control": {"oneOf": [{"type": "null"}, _open({"type": {"const": "ephemeral"}}, [])]},
        "output_config": {
            "oneOf": [
                {"type": "null"},
                _object(
                    {
                        "format": _object(
                            {"type": {"const": "json_schema"}, "schema": {"type": "object"}},
                            ["type", "schema"],
                        ),
                        "effort": {"enum": [*EFFORTS, None]},
                    },
                    [],
                ),
            ]
        },
        **{name: {"enum": _distinct(values)} for name, (values, _) in ANTHROPIC_NEUTRAL.items()},
    }


_MESSAGE_FIELDS: Schema = {
    "id": {"type": "string"},
    "type": {"const": "message"},
    "role": {"const": "assistant"},
    "content": {"type": "array", "items": {"type": "object"}},
    "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
    "usage": _open(
        {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}},
        ["input_tokens", "output_tokens"],
    ),
}


def _anthropic_operation(
    summary: str, request: Schema, response: Schema, streams: bool = True
) -> Schema:
    content = {JSON: {"schema": response}, **({SSE: {"schema": {}}} if streams else {})}
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
        "responses": {
            "200": {"description": summary, "content": content},
            **_anthropic_errors(400, 404, 413, 415, 429, 503),
        },
    }


def _anthropic_errors(*statuses: int) -> Schema:
    reference = {"$ref": "#/components/schemas/AnthropicError"}
    return {str(status): _json_content(_ERROR_TEXT[status], reference) for status in statuses}


def _anthropic_error_schema() -> Schema:
    error = _object_open({"type": {"type": "string"}, "message": {"type": "string"}})
    return _object_open({"type": {"const": "error"}, "error": error})


def _text_format() -> Schema:
    """The Responses' `text`: its format (enforced as the chat's response_format)."""
    json_schema = _open(
        {
            "type": {"const": "json_schema"},
            "name": {"type": "string"},
            "description": {"type": "string"},
            "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]},
        },
        ["type", "name", "schema"],
    )
    kinds = _object({"type": {"enum": ["text", "json_object"]}}, ["type"])
    return {
        "oneOf": [
            {"type": "null"},
            _object({"format": {"oneOf": [{"type": "null"}, kinds, json_schema]}}, []),
        ]
    }


def _embeddings(max_model_len: int | None) -> Schema:
    """OpenAI's, with vLLM's extra fields; pooled as --pooling-type says."""
    request = _open(
        {
            "input": _prompts(max_model_len, MAX_EMBEDDING_INPUTS),
            "model": {"type": ["string", "null"]},
            "encoding_format": {"enum": ["float", "base64", None]},
            "normalize": {"type": ["boolean", "null"]},
            "add_special_tokens": {"type": ["boolean", "null"]},
            "truncate_prompt_tokens": {"type": ["integer", "null"], "minimum": -1},
            "user": {"type": ["string", "null"]},
            "priority": count_schema("priority", None),
        },
        ["input"],
    )
    vector = {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}
    item = _object_open(
        {"index": {"type": "integer"}, "object": {"const": "embedding"}, "embedding": vector}
    )
    response = _object_open(
        {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "model": {"type": "string"},
            "usage": _object_open(
                {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}
            ),
        }
    )
    operation = _generation("Embeddings of one input or a list of them", request)
    operation["responses"]["200"] = _json_content("The embeddings", response)
    return operation


def _completion_request(max_model_len: int | None) -> Schema:
    prompt = {
        **_prompts(max_model_len, MAX_BATCH_PROMPTS),
        "description": "a prompt, or a list of them (vLLM's batch: prompt i's choice j is "
        "choice i x n + j)",
    }
    return _request(
        {
            "prompt": prompt,
            "logprobs": count_schema("logprobs", max_model_len),
            "echo": {
                "type": ["boolean", "null"],
                "description": "the prompt comes back before the completion; with logprobs, "
                "its tokens' log-probabilities too (the first token's is null)",
            },
        },
        ["prompt"],
        max_model_len,
    )


def _chat_request(max_model_len: int | None) -> Schema:
    part = _object({"type": {"const": "text"}, "text": {"type": "string"}}, ["type", "text"])
    content = {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}
    content = {"oneOf": [*content["oneOf"], {"type": "null"}]}  # null: a turn of tool calls
    call = _open(
        {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": _open(
                {"name": {"type": "string"}, "arguments": {"type": "string"}}, ["name"]
            ),
        },
        ["function"],
    )
    message = {
        "type": "object",
        "properties": {
            "role": {"enum": list(CHAT_ROLES)},
            "content": content,
            "tool_calls": {"type": "array", "items": call},
            "tool_call_id": {"type": "string", "description": "a tool message's call"},
        },
        "required": ["role"],
    }
    return _request(
        {
            "messages": {
                "type": "array",
                "items": message,
                "minItems": 1,
                "maxItems": MAX_CHAT_MESSAGES,
            },
            "max_completion_tokens": count_schema("max_completion_tokens", max_model_len),
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": count_schema("top_logprobs", max_model_len),
            "thinking_token_budget": count_schema("thinking_token_budget", max_model_len),
            **_tool_fields(),
        },
        ["messages"],
        max_model_len,
    )


def _tool_fields() -> Schema:
    """A chat's tools and what its template gets."""
    function = _open(
        {
            "name": {"type": "string", "minLength": 1},
            "description": {"type": "string"},
            "parameters": {"type": "object"},
        },
        ["name"],
    )
    tool = _open({"type": {"const": "function"}, "function": function}, ["type", "function"])
    named = _open(
        {"type": {"const": "function"}, "function": _open({"name": {"type": "string"}}, ["name"])},
        ["type", "function"],
    )
    return {
        "tools": {"type": ["array", "null"], "items": tool},
        "tool_choice": {
            "oneOf": [{"type": "null"}, {"enum": list(TOOL_CHOICES)}, named],
            "description": "auto needs --tool-call-parser; required and a named function are "
            "enforced by the grammar engine (the arguments fit the tool's parameters)",
        },
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "chat_template": {
            "type": ["string", "null"],
            "description": "a Jinja chat template for this request (needs "
            "--trust-request-chat-template)",
        },
        "chat_template_kwargs": {"type": ["object", "null"]},
        "reasoning_effort": {
            "oneOf": [{"type": "null"}, {"enum": list(REASONING_EFFORTS)}],
            "description": "passed to the chat template as `reasoning_effort`",
        },
        "include_reasoning": {
            "type": ["boolean", "null"],
            "description": "vLLM's: false leaves reasoning_content out (--reasoning-parser)",
        },
    }


def _request(own: Schema, required: list[str], max_model_len: int | None) -> Schema:
    """A generation request: its own fields, the sampling fields both kinds share, and the
    OpenAI fields accepted only with their neutral value."""
    stop_text = {"type": "string", "minLength": 1}
    shared = {
        "model": {"type": ["string", "null"]},
        "max_tokens": count_schema("max_tokens", max_model_len),
        "temperature": _number(0, MAX_TEMPERATURE),
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1},
        "seed": count_schema("seed", max_model_len),
        "n": count_schema("n", max_model_len),
        "best_of": count_schema("best_of", max_model_len),
        "stop": {
            "oneOf": [
                {"type": "null"},
                stop_text,
                {"type": "array", "items": stop_text, "maxItems": MAX_STOP_STRINGS},
            ]
        },
        "ignore_eos": {"type": ["boolean", "null"]},
        "skip_special_tokens": {"type": ["boolean", "null"]},
        "cache_salt": {
            "type": ["string", "null"],
            "minLength": 1,
            "maxLength": MAX_CACHE_SALT_CHARS,
            "description": "vLLM's: only requests with the same salt share cached prefixes",
        },
        "stream": {"type": ["boolean", "null"]},
        "stream_options": _stream_options(),
        "response_format": _response_format(),
        **_logit_processors(max_model_len),
        **_grammars(),
        **_routing(),
    }
    neutral = {
        name: {"enum": _distinct(values)}
        for name, values in NEUTRAL_VALUES.items()
        if values and name not in shared
    }
    schema = _object({**neutral, **shared, **own}, required)
    schema["additionalProperties"] = True  # unknown fields are ignored (and logged), as vLLM does
    return schema


def _routing() -> dict[str, Schema]:
    """Who a request is for and when it must start: tenant, priority, deadline."""
    return {
        "user": {"type": ["string", "null"], "maxLength": MAX_TENANT_CHARS},
        "priority": count_schema("priority", None),
        "deadline_ms": {
            "type": ["number", "null"],
            "exclusiveMinimum": 0,
            "maximum": MAX_DEADLINE_S * 1000,
            "description": "cadence: milliseconds the request may wait to start; if it "
            "cannot, 429 (overloaded at arrival, deadline_exceeded later; with Retry-After)",
        },
        "kv_transfer_params": {
            "type": ["object", "null"],
            "description": "vLLM's prefill/decode handover, with --kv-transfer-role: "
            "{do_remote_decode: true} to a producer, whose answer's kv_transfer_params go "
            "whole to a consumer (README: Prefill and decode on two servers); 400 otherwise",
        },
    }


def _logit_processors(max_model_len: int | None) -> dict[str, Schema]:
    """vLLM's sampling parameters beyond temperature, top-p and top-k (as vLLM defines them)."""
    ids: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    return {
        "presence_penalty": _number(-MAX_PENALTY, MAX_PENALTY),
        "frequency_penalty": _number(-MAX_PENALTY, MAX_PENALTY),
        "repetition_penalty": {
            "type": ["number", "null"],
            "exclusiveMinimum": 0,
            "description": "vLLM's: logits of tokens in the prompt or output divided by it "
            "(multiplied where negative)",
        },
        "min_p": _number(0, 1),
        "logit_bias": {
            "type": ["object", "null"],
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "maxProperties": MAX_LOGIT_BIAS_TOKENS,
            "description": "token id (as a string) -> bias added to its logit",
        },
        "allowed_token_ids": {"oneOf": [{"type": "null"}, {**ids, "minItems": 1}]},
        "stop_token_ids": {"oneOf": [{"type": "null"}, {**ids, "maxItems": MAX_STOP_TOKEN_IDS}]},
        "min_tokens": count_schema("min_tokens", max_model_len),
        "bad_words": {
            "oneOf": [
                {"type": "null"},
                {"type": "array", "items": {"type": "string"}, "maxItems": MAX_BAD_WORDS},
            ]
        },
    }


def _grammars() -> dict[str, Schema]:
    """vLLM's structured output fields (one at most, response_format included)."""
    text = {"type": ["string", "null"], "minLength": 1}
    choices = {"oneOf": [{"type": "null"}, {"type": "array", "items": {"type": "string"}}]}
    kinds = {
        "json": {"type": ["object", "string"]},
        "regex": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}},
        "grammar": {"type": "string", "description": "EBNF (xgrammar's), from rule root"},
        "json_object": {"type": "boolean"},
        "structural_tag": {"type": ["object", "string"]},
    }
    return {
        "structured_outputs": {
            "oneOf": [{"type": "null"}, {"type": "object", "properties": kinds}],
            "description": "vLLM's (>= 0.10): one of json, regex, choice, grammar, "
            "json_object, structural_tag",
        },
        "guided_json": {"type": ["object", "string", "null"]},
        "guided_regex": text,
        "guided_choice": choices,
        "guided_grammar": text,
        "regex": text,  # SGLang's
        "ebnf": text,
        "json_schema": {"type": ["object", "string", "null"]},
    }


def _distinct(values: tuple) -> list:
    """Without repeats by JSON equality: 0 and 0.0 are one number, False is not 0."""
    seen: list = []
    for value in values:
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in seen):
            seen.append(value)
    return seen


def _response_format() -> Schema:
    """OpenAI's structured output (needs xgrammar on the server, else a 400)."""
    json_schema = _open(
        {
            "name": {"type": "string"},
            "description": {"type": "string"},
            "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]},
        },
        ["name", "schema"],
    )
    return {
        "oneOf": [
            {"type": "null"},
            _open({"type": {"enum": ["text", "json_object"]}}, ["type"]),
            _open(
                {"type": {"const": "json_schema"}, "json_schema": json_schema},
                ["type", "json_schema"],
            ),
            _open({"type": {"const": "structural_tag"}}, ["type"]),
        ],
        "description": "text (the default), any JSON object, or JSON that fits "
        f"json_schema.schema (at most {MAX_SCHEMA_BYTES // 1024} KiB serialized; a schema "
        "the grammar compiler rejects, or a json_schema without name and schema, is a 400). "
        "Properties come in the schema's order; only those it names, unless it allows more.",
    }


def _stream_options() -> Schema:
    """Allowed only with stream=true (a 400 otherwise)."""
    flags = {"include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}
    return {"oneOf": [{"type": "null"}, _object(flags, [])]}


def _prompts(max_model_len: int | None, most: int) -> Schema:
    """A text or token-id prompt, or a list of up to `most` of either."""
    ids = _token_ids(max_model_len)
    text = {"type": "string", "minLength": 1}
    lists = [
        {"type": "array", "items": one, "minItems": 1, "maxItems": most} for one in (text, ids)
    ]
    return {"oneOf": [text, ids, *lists]}


def _token_ids(max_model_len: int | None) -> Schema:
    ids: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    if max_model_len is not None:
        ids["maxItems"] = max_model_len
    return ids


def _completion_response() -> Schema:
    choice = {
        "type": "object",
        "properties": {
            "index": {"type": "integer"},
            "finish_reason": {"type": ["string", "null"]},
        },
        "required": ["index", "finish_reason"],
    }
    counts: Schema = {name: {"type": "integer", "minimum": 0} for name in _USAGE_FIELDS}
    cached = {"cached_tokens": {"type": "integer", "minimum": 0}}
    # null where the operator does not report cached tokens (--enable-prompt-tokens-details)
    reported = _object(cached, ["cached_tokens"])
    details = {"prompt_tokens_details": {"anyOf": [reported, {"type": "null"}]}}
    usage = _object({**counts, **details}, [*_USAGE_FIELDS, "prompt_tokens_details"])
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"enum": ["text_completion", "chat.completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": choice,
                "minItems": 1,
                "maxItems": MAX_SEQUENCES,
            },
            "usage": usage,
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    }


_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def _models_schema() -> Schema:
    card = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "max_model_len": {"type": "integer"},
        },
        "required": ["id", "object"],
    }
    return _object({"object": {"const": "list"}, "data": {"type": "array", "items": card}}, [])


def _health_schema() -> Schema:
    return {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "unavailable"]},
            "policy": _policy_info(),
            "last_worker_failure": _object(
                {
                    "reason": {"enum": ["worker_died", "worker_hung", "device_error"]},
                    "at": {"type": "number", "description": "Unix time"},
                },
                ["reason", "at"],
            ),
        },
        "required": ["status", "policy"],
    }


# ---- /admin ------------------------------------------------------------------------------


def _admin_paths() -> Schema:
    state = {
        "type": "object",
        "properties": {"policy": _policy_info(), "worker_ready": {"type": "boolean"}},
        "required": ["policy", "worker_ready"],
    }
    listing = {
        "type": "object",
        "properties": {"current": _policy_info(), "available": {"type": "array"}},
        "required": ["current", "available"],
    }
    reset = _object({"reset_blocks": {"type": "integer", "minimum": 0}}, ["reset_blocks"])
    swap = _object(
        {"old": _policy_info(), "new": _policy_info(), "iteration": {"type": "integer"}}, []
    )
    return {
        "/admin/policy": {
            "get": _admin(_get("The policy in force and those available", listing)),
            "put": _admin(
                {
                    "summary": "Swap the scheduling policy (takes effect at the next iteration)",
                    "requestBody": {
                        "required": True,
                        "content": {JSON: {"schema": _policy_swap()}},
                    },
                    "responses": {
                        "200": _json_content("Swapped", swap),
                        **_errors(400, 415),
                    },
                }
            ),
        },
        "/admin/state": {"get": _admin(_get("Engine state", state))},
        "/reset_prefix_cache": {
            "post": _admin(
                {
                    "summary": "Forget every cached prefix (vLLM's endpoint)",
                    "responses": {"200": _json_content("Reset", reset)},
                }
            )
        },
        "/v1/load_lora_adapter": {
            "post": _lora_route(
                "Serve a LoRA adapter (vLLM's endpoint)", ["lora_name", "lora_path"]
            )
        },
        "/v1/unload_lora_adapter": {
            "post": _lora_route("Stop serving a LoRA adapter (vLLM's endpoint)", ["lora_name"])
        },
    }


def _lora_route(summary: str, fields: list[str]) -> Schema:
    """vLLM's run-time LoRA routes: a JSON body of strings, a text answer (--enable-lora)."""
    body = _object_open({name: {"type": "string", "minLength": 1} for name in fields})
    return _admin(
        {
            "summary": summary,
            "requestBody": {"required": True, "content": {JSON: {"schema": body}}},
            "responses": {
                "200": _content("Done", "text/plain", {"type": "string"}),
                **_errors(400, 404),
            },
        }
    )


def _admin(operation: Schema) -> Schema:
    operation["security"] = [{"admin": []}]
    operation["responses"].update(_errors(401, 403))
    return operation


def _policy_swap() -> Schema:
    return {
        "oneOf": [
            _object({"name": {"const": name}, "params": _policy_params(cls.Params)}, ["name"])
            for name, cls in POLICIES.items()
        ]
    }


def _policy_params(params_cls: type) -> Schema:
    """A policy's parameters from its dataclass: type and the metadata's min and max."""
    properties = {}
    for spec in dataclasses.fields(params_cls):
        kind = spec.type if isinstance(spec.type, str) else spec.type.__name__
        schema: Schema = {"type": _PARAM_TYPES.get(kind.partition("[")[0], "object")}
        if "min" in spec.metadata:
            schema["minimum"] = spec.metadata["min"]
        if "max" in spec.metadata:
            schema["maximum"] = spec.metadata["max"]
        properties[spec.name] = schema
    return {"oneOf": [{"type": "null"}, _object(properties, [])]}


_PARAM_TYPES = {"int": "integer", "float": "number", "bool": "boolean", "dict": "object"}


def _policy_info() -> Schema:
    return _object_open({"name": {"enum": list(POLICIES)}, "params": {"type": "object"}})


# ---- building blocks ---------------------------------------------------------------------


def _object(properties: Schema, required: list[str]) -> Schema:
    """A JSON object with exactly these fields: the server rejects unknown ones."""
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _object_open(properties: Schema) -> Schema:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _number(low: float, high: float) -> Schema:
    return {"type": ["number", "null"], "minimum": low, "maximum": high}


def _get(summary: str, schema: Schema) -> Schema:
    return {"summary": summary, "responses": {"200": _json_content(summary, schema)}}


def _json_content(description: str, schema: Schema) -> Schema:
    return _content(description, JSON, schema)


def _content(description: str, media_type: str, schema: Schema) -> Schema:
    return {"description": description, "content": {media_type: {"schema": schema}}}


def _errors(*statuses: int) -> Schema:
    reference = {"$ref": "#/components/schemas/Error"}
    return {str(status): _json_content(_ERROR_TEXT[status], reference) for status in statuses}


_ERROR_TEXT = {
    400: "Invalid request",
    401: "Missing or wrong bearer token (the admin token, or an API key)",
    403: "Wrong admin token, admin disabled, or a field or route the API key may not use",
    404: "Unknown model",
    413: "Body too large",
    415: "Body not declared application/json",
    429: "Overloaded, or it could not start before its deadline: retry later",
    503: "Worker not ready, restarting or shutting down",
}


def _error_schema() -> Schema:
    error = _object_open(
        {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        }
    )
    return _object_open({"error": error})
