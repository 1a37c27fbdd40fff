"""Request parsing: every malformed body is a 400 naming the field; good bodies map 1:1.

Whether values are in range is the engine's validation (tests/test_engine_basic.py), which
the HTTP tests (tests/test_api_errors.py) see as the same 400s.
"""

from __future__ import annotations

import pytest

from service.api.errors import APIError
from service.api.openai_schema import parse_chat_request, parse_completion_request

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
    assert (p.stop, p.ignore_eos, s.logprobs) == (["\n"], True, True)
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


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
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
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, "stream_options"),
        ({"prompt": "x", "logprobs": 9}, "logprobs"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": "x", "user": 3}, "user"),
        ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
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
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
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
