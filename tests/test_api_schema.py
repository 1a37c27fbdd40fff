"""Request parsing: every malformed body is a 400 naming the field; good bodies map 1:1.

Whether values are in range is the engine's validation (tests/test_engine_basic.py), which
the HTTP tests (tests/test_api_errors.py) see as the same 400s.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from service.api.app import create_app
from service.api.errors import APIError
from service.api.openai_schema import (
    GenerationRequest,
    PromptBound,
    parse_chat_request,
    parse_completion_request,
)
from service.api.openapi import openapi_document
from service.config import Config
from service.engine.engine import Engine
from service.engine.grammar import ResponseFormat
from tests.sim_worker import SimTokenizer, SimWorker

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_completion_fields_map_onto_sampling_params() -> None:
    req = parse_completion_request(
        {
            "model": "m",
            "prompt": "Hello",
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "seed": 42,
            "stop": "\n",
            "ignore_eos": True,
            "priority": 5,
            "user": "alice",
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 0,
        },
        header_tenant=None,
    )
    p, s = req.params, req.params.sampling
    assert (p.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.0, 0.5, 3, 42)
    assert (p.stop, p.ignore_eos, s.logprobs, s.top_logprobs) == (["\n"], True, True, 0)
    assert (req.echo, s.prompt_logprobs) == (False, None)
    assert (req.prompt, req.tenant, req.priority, req.stream, req.include_usage) == (
        "Hello",
        "alice",
        5,
        True,
        True,
    )


def test_header_tenant_wins_over_user_field() -> None:
    req = parse_completion_request({"prompt": "x", "user": "alice"}, header_tenant="team-a")
    assert req.tenant == "team-a"


def test_chat_max_completion_tokens_and_text_parts() -> None:
    req = parse_chat_request(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 9,
        },
        header_tenant=None,
    )
    assert req.params.max_tokens == 9
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


def test_chat_without_max_tokens_leaves_it_to_the_context_window() -> None:
    assert parse_chat_request(CHAT, None).params.max_tokens is None
    assert parse_completion_request({"prompt": "x"}, None).params.max_tokens == 16


def test_single_element_prompt_lists_are_one_prompt() -> None:
    assert parse_completion_request({"prompt": ["hi"]}, None).prompt == "hi"
    assert parse_completion_request({"prompt": [[1, 2]]}, None).prompt == [1, 2]
    assert parse_completion_request({"prompt": [5, 6]}, None).prompt == [5, 6]


def test_prompt_lists_are_a_batch() -> None:
    request = parse_completion_request({"prompt": ["hi", "there"], "best_of": 3}, None)
    assert (request.prompt, request.batch, request.sequences) == ("hi", ["hi", "there"], 6)
    assert parse_completion_request({"prompt": [[1, 2], [3]]}, None).batch == [[1, 2], [3]]
    assert parse_completion_request({"prompt": ["hi"]}, None).batch is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a"] * 33}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[1], [-1]]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": 12}, "prompt"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": "1"}, "top_p"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "x", "priority": "high"}, "priority"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, "stream_options"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": "x", "user": 3}, "user"),
        ({"prompt": "x", "frequency_penalty": "high"}, "frequency_penalty"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "min_tokens": 1.5}, "min_tokens"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"3": "up"}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": [3]}, "logit_bias"),
        ({"prompt": "x", "allowed_token_ids": [1, "2"]}, "allowed_token_ids"),
        ({"prompt": "x", "stop_token_ids": 5}, "stop_token_ids"),
        ({"prompt": "x", "bad_words": "word"}, "bad_words"),
        ({"prompt": "x", "guided_choice": []}, "guided_choice"),
        ({"prompt": "x", "guided_regex": 3}, "guided_regex"),
        ({"prompt": "x", "guided_json": "[1"}, "guided_json"),
        ({"prompt": "x", "structured_outputs": {"regex": ""}}, "structured_outputs"),
        ({"prompt": "x", "structured_outputs": {"lark": "x"}}, "structured_outputs"),
        (
            {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"prompt": "x", "response_format": {"type": "structural_tag"}}, "response_format"),
        ({"prompt": "x", "no_stop_trim": True}, "no_stop_trim"),
        ({"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "x", "cache_salt": 7}, "cache_salt"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_field(body: object, param: str | None) -> None:
    with pytest.raises(APIError) as info:
        parse_completion_request(body, None)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({**CHAT, "echo": True}, "echo"),
        ({**CHAT, "logprobs": 1}, "logprobs"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_field(body: object, param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_chat_request(body, None)
    assert (info.value.status, info.value.param) == (400, param)


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    req = parse_completion_request(
        {
            "prompt": "x",
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "best_of": 1,
            "echo": False,
            "logit_bias": {},
            "top_k": -1,
        },
        None,
    )
    assert req.params.sampling.top_k == 0


def test_unknown_fields_are_ignored_and_named_and_known_ones_honoured() -> None:
    req = parse_chat_request(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5,  # sglang-router's rewrite of max_tokens
            "skip_special_tokens": False,
            "separate_reasoning": False,
            "stream_reasoning": True,
            "stop_token_ids": [],
            "frobnicate": 1,
            "temprature": 0.3,
        },
        None,
    )
    assert req.ignored == ("frobnicate", "temprature")
    assert req.params.max_tokens == 5 and req.params.skip_special_tokens is False
    assert req.params.cache_salt is None
    salted = parse_completion_request({"prompt": "x", "cache_salt": "t1"}, None)
    assert salted.params.cache_salt == "t1"
    assert parse_completion_request({"prompt": "x"}, None).ignored == ()


@pytest.mark.parametrize("field", ["bootstrap_host", "bootstrap_port", "bootstrap_room"])
def test_a_prefill_decode_handover_is_refused_and_its_null_accepted(field: str) -> None:
    """sglang-router in PD mode sends bootstrap_* to both halves: cadence would compute each
    request twice in full, so a value is a 400 that says why; null asks for nothing."""
    assert parse_chat_request({**CHAT, field: None}, None).ignored == ()
    for value in (7, "10.0.0.2", 0):
        with pytest.raises(APIError) as refused:
            parse_chat_request({**CHAT, field: value}, None)
        assert refused.value.status == 400 and refused.value.param == field
        assert "prefill/decode handover" in refused.value.message
    with pytest.raises(APIError, match="only None is accepted"):
        parse_completion_request({"prompt": "x", field: 1234}, None)


def test_a_known_field_at_a_value_asking_for_more_is_a_400_naming_it() -> None:
    with pytest.raises(APIError, match="'use_beam_search' is not supported by this server"):
        parse_completion_request({"prompt": "x", "use_beam_search": True}, None)


BOUND = PromptBound(max_tokens=8, max_token_chars=4)  # texts of more than 32 characters


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_completion_request, {"prompt": "x" * 33}, "prompt"),
        (parse_completion_request, {"prompt": ["x" * 33]}, "prompt"),
        # the length is checked before the ids themselves (-1 would be another 400)
        (parse_completion_request, {"prompt": [-1] * 9}, "prompt"),
        (parse_completion_request, {"prompt": [[1] * 9]}, "prompt"),
        (parse_chat_request, {"messages": [{"role": "user", "content": "x" * 33}]}, "messages"),
        (
            parse_chat_request,
            {
                "messages": [
                    {"role": "system", "content": "x" * 20},
                    {"role": "user", "content": [{"type": "text", "text": "x" * 13}]},
                ]
            },
            "messages",
        ),
    ],
)
def test_a_prompt_that_cannot_fit_is_rejected_before_tokenizing(
    parse: Callable[..., GenerationRequest], body: dict, param: str
) -> None:
    with pytest.raises(APIError) as info:
        parse(body, None, BOUND)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.code == "context_length_exceeded"


def test_a_prompt_at_the_bound_is_parsed() -> None:
    assert parse_completion_request({"prompt": "x" * 32}, None, BOUND).prompt == "x" * 32
    assert parse_completion_request({"prompt": [1] * 8}, None, BOUND).prompt == [1] * 8
    chat = {"messages": [{"role": "user", "content": "x" * 32}]}
    assert parse_chat_request(chat, None, BOUND).messages is not None


def test_the_openapi_document_describes_every_route() -> None:
    config = Config()
    engine = Engine(config, SimWorker(), SimTokenizer())
    app = create_app(config, engine, SimTokenizer(), "sim")  # type: ignore[arg-type]
    served = {
        (rule.rule, method)
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static"
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    paths = openapi_document(64, "sim")["paths"]
    described = {
        (path, method.upper()) for path, operations in paths.items() for method in operations
    }
    assert described == served


@pytest.mark.parametrize(
    ("body", "echo", "top", "prompt_top"),
    [
        ({"logprobs": 3}, False, 3, None),
        ({"logprobs": 3, "echo": True}, True, 3, 3),
        ({"echo": True}, True, None, None),  # the prompt's text only: no logprobs to compute
    ],
)
def test_completion_logprobs_and_echo_reach_the_sampling_spec(body, echo, top, prompt_top) -> None:
    req = parse_completion_request({"prompt": "x", **body}, None)
    s = req.params.sampling
    assert (req.echo, s.logprobs, s.prompt_logprobs) == (echo, top is not None, prompt_top)
    assert s.top_logprobs == (top or 0)


@pytest.mark.parametrize(
    ("body", "logprobs", "top"),
    [
        ({"logprobs": True}, True, 0),
        ({"logprobs": True, "top_logprobs": 20}, True, 20),
        ({}, False, 0),
    ],
)
def test_chat_top_logprobs_reach_the_sampling_spec(body, logprobs, top) -> None:
    s = parse_chat_request({**CHAT, **body}, None).params.sampling
    assert (s.logprobs, s.top_logprobs, s.prompt_logprobs) == (logprobs, top, None)


@pytest.mark.parametrize(
    ("body", "n", "best_of"),
    [({}, 1, 1), ({"n": 3}, 3, 3), ({"best_of": 4}, 1, 4), ({"n": 2, "best_of": 5}, 2, 5)],
)
def test_n_and_best_of_default_to_one_sequence_per_choice(body, n, best_of) -> None:
    for parse, base in ((parse_completion_request, {"prompt": "x"}), (parse_chat_request, CHAT)):
        req = parse({**base, **body}, None)
        assert (req.n, req.best_of) == (n, best_of)


def nested_items(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_response_formats_parse_into_what_the_grammar_compiler_takes() -> None:
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}  # key order kept
    spec = {"name": "n", "schema": schema, "strict": True}
    parsed = parse_chat_request(
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": spec}}, None
    )
    assert parsed.response_format == ResponseFormat(
        "json_schema", '{"type":"object","properties":{"b":{},"a":{}}}'
    )
    as_object = parse_completion_request(
        {"prompt": "x", "response_format": {"type": "json_object"}}, None
    )
    assert as_object.response_format == ResponseFormat("json_object")
    assert (
        parse_chat_request({**CHAT, "response_format": {"type": "text"}}, None).response_format
        is None
    )


@pytest.mark.parametrize(
    "response_format",
    [
        "json_object",
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": []}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "strict": "yes"}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["x" * 70_000]}}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": nested_items(300)}},
    ],
)
def test_a_malformed_response_format_is_a_400_naming_it(response_format: object) -> None:
    with pytest.raises(APIError) as info:
        parse_chat_request({**CHAT, "response_format": response_format}, None)
    assert (info.value.status, info.value.param) == (400, "response_format")


def test_vllms_sampling_parameters_reach_the_spec_and_the_params() -> None:
    parsed = parse_chat_request(
        {
            **CHAT,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "min_p": 0.05,
            "logit_bias": {"50": -100, "7": 2.5},
            "allowed_token_ids": [1, 2, 3],
            "min_tokens": 2,
            "stop_token_ids": [9],
            "bad_words": ["darn", "heck"],
        },
        None,
    )
    spec = parsed.params.sampling
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (
        0.5,
        -1.0,
        1.2,
    )
    assert (spec.min_p, spec.min_tokens, spec.allowed_token_ids) == (0.05, 2, [1, 2, 3])
    assert spec.logit_bias == [(7, 2.5), (50, -100.0)]
    assert (parsed.params.stop_token_ids, parsed.params.bad_words) == ([9], ["darn", "heck"])


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"guided_regex": "[a-z]+"}, ResponseFormat("regex", "[a-z]+", "guided_regex")),
        ({"guided_choice": ["a", 'b"']}, ResponseFormat("choice", '["a","b\\""]', "guided_choice")),
        ({"guided_grammar": 'root ::= "x"'}, ResponseFormat("grammar", 'root ::= "x"')),
        ({"guided_json": '{"type": "object"}'}, ResponseFormat("json_schema", '{"type":"object"}')),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            ResponseFormat("choice", '["yes","no"]'),
        ),
        (
            {"structured_outputs": {"json": {"type": "integer"}}},
            ResponseFormat("json_schema", '{"type":"integer"}'),
        ),
        ({"structured_outputs": {"json_object": True}}, ResponseFormat("json_object")),
        (
            {"structured_outputs": {"grammar": "root ::= [0-9]", "disable_fallback": False}},
            ResponseFormat("grammar", "root ::= [0-9]"),
        ),
    ],
)
def test_vllms_grammar_fields_parse_into_response_formats(fields, expected) -> None:
    parsed = parse_completion_request({"prompt": "x", **fields}, None).response_format
    assert parsed == expected and parsed.param == next(iter(fields))


def test_a_structural_tag_goes_to_the_compiler_whole() -> None:
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    parsed = parse_chat_request({**CHAT, "response_format": tag}, None).response_format
    assert parsed is not None and parsed.type == "structural_tag"
    assert json.loads(parsed.schema or "") == tag
