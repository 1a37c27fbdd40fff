"""Bad input against a real server: each case gets its 4xx in the OpenAI shape; server stays up."""

from __future__ import annotations

import httpx
import pytest

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (name, method, path, json body or raw bytes, expected status, expected error code or None)
CASES = [
    ("invalid json", "POST", COMPLETIONS, b"{not json", 400, None),
    ("empty body", "POST", COMPLETIONS, b"", 400, None),
    ("body not an object", "POST", COMPLETIONS, [1, 2], 400, None),
    ("missing prompt", "POST", COMPLETIONS, {"max_tokens": 3}, 400, None),
    ("empty prompt", "POST", COMPLETIONS, {"prompt": ""}, 400, None),
    ("a batch with an empty prompt", "POST", COMPLETIONS, {"prompt": ["a", ""]}, 400, None),
    ("prompt wrong type", "POST", COMPLETIONS, {"prompt": {"a": 1}}, 400, None),
    ("token id beyond vocabulary", "POST", COMPLETIONS, {"prompt": [1, 10**7]}, 400, None),
    ("max_tokens zero", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, None),
    ("max_tokens string", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, 400, None),
    ("negative temperature", "POST", COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, None),
    ("absurd temperature", "POST", COMPLETIONS, {"prompt": "x", "temperature": 1e9}, 400, None),
    ("top_p zero", "POST", COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, None),
    ("n=40", "POST", COMPLETIONS, {"prompt": "x", "n": 40}, 400, None),
    # vLLM's and SGLang's fields, at values out of their ranges or asking for what cadence
    # does not do
    (
        "min_tokens",
        "POST",
        COMPLETIONS,
        {"prompt": "x", "min_tokens": 5, "max_tokens": 3},
        400,
        None,
    ),
    ("guided_json", "POST", COMPLETIONS, {"prompt": "x", "guided_json": "[1"}, 400, None),
    ("logit_bias", "POST", COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, 400, None),
    ("continuing", "POST", CHAT, {"messages": USER, "continue_final_message": True}, 400, None),
    ("skip_special 1", "POST", COMPLETIONS, {"prompt": "x", "skip_special_tokens": 1}, 400, None),
    (
        "context window exceeded",
        "POST",
        COMPLETIONS,
        {"prompt": [1] * 8000, "max_tokens": 1000},
        400,
        "context_length_exceeded",
    ),
    (
        "absurd max_tokens",
        "POST",
        COMPLETIONS,
        {"prompt": "x", "max_tokens": 10**9},
        400,
        "context_length_exceeded",
    ),
    (
        "unknown model",
        "POST",
        COMPLETIONS,
        {"prompt": "x", "model": "gpt-17"},
        404,
        "model_not_found",
    ),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, None),
    ("bad role", "POST", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("chat n=0", "POST", CHAT, {"messages": USER, "n": 0}, 400, None),
    (
        "chat stream_options without stream",
        "POST",
        CHAT,
        {"messages": USER, "stream_options": {"include_usage": True}},
        400,
        None,
    ),
    (
        "oversized body",
        "POST",
        COMPLETIONS,
        b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
        413,
        "request_too_large",
    ),
    ("wrong method", "GET", COMPLETIONS, None, 405, "method_not_allowed"),
    ("unknown route", "GET", "/v1/nothing-here", None, 404, "not_found"),
]


def body_of(body: object) -> dict:
    """httpx arguments sending `body`: raw bytes still declared JSON, to reach the parser."""
    if body is None:
        return {}
    if isinstance(body, bytes):
        return {"content": body, "headers": {"Content-Type": "application/json"}}
    return {"json": body}


@pytest.mark.parametrize(
    ("name", "method", "path", "body", "status", "code"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_gets_its_status_in_openai_shape(
    cadence_server: RunningServer,
    name: str,
    method: str,
    path: str,
    body: object,
    status: int,
    code: str | None,
) -> None:
    response = httpx.request(method, f"{cadence_server.url}{path}", timeout=60, **body_of(body))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code


# Values out of the engine's ranges: its validation names its own argument, the API the
# client's field.
OUT_OF_RANGE = [
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": "x", "n": 33}, "n"),
    (COMPLETIONS, {"prompt": "x", "best_of": 33}, "best_of"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21, "echo": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "deadline_ms": 0}, "deadline_ms"),
    (COMPLETIONS, {"prompt": "x", "deadline_ms": 86_400_001}, "deadline_ms"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": USER, "n": 33}, "n"),
]


@pytest.mark.parametrize(("path", "body", "param"), OUT_OF_RANGE)
def test_a_value_out_of_range_is_a_400_naming_the_clients_field(
    cadence_server: RunningServer, path: str, body: dict, param: str
) -> None:
    response = httpx.post(f"{cadence_server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_server_is_healthy_and_serving_after_bad_input(cadence_server: RunningServer) -> None:
    for _, method, path, body, _, _ in CASES:
        httpx.request(method, f"{cadence_server.url}{path}", timeout=60, **body_of(body))
    assert httpx.get(f"{cadence_server.url}/health").status_code == 200
    ok = httpx.post(
        f"{cadence_server.url}{COMPLETIONS}",
        json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert cadence_server.wait_idle()["kv_blocks_used"] == 0
