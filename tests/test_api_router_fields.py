"""What routers and vLLM/SGLang clients add to each body, against a real server: their
extension fields at neutral values are accepted, the ones cadence can honour are honoured,
and a field it does not know is ignored and logged, as vLLM does (the 400s for fields that
ask for missing behaviour are in test_api_errors.py)."""

from __future__ import annotations

import time

import httpx
import openai
import orjson
import pytest

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# what sglang-router and vllm-router were seen adding to chat bodies, and more of vLLM's
# and SGLang's extension fields, at the values that ask for nothing more
ROUTER_FIELDS = {
    "continue_final_message": False,
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
    "add_generation_prompt": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "min_tokens": 0,
    "stop_token_ids": [],
    "chat_template_kwargs": None,
    "rid": "router-7",
    "bootstrap_room": None,
}


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_body_as_a_router_rewrites_it_is_answered(
    cadence_server: RunningServer, stream: bool
) -> None:
    """sglang-router sends max_completion_tokens instead of max_tokens, plus its fields."""
    client = client_for(cadence_server)
    plain = client.chat.completions.create(
        model=cadence_server.model, messages=QUESTION, max_tokens=12, temperature=0
    )
    extra = {**ROUTER_FIELDS, "max_completion_tokens": 12}
    routed = client.chat.completions.create(
        model=cadence_server.model, messages=QUESTION, temperature=0, stream=stream,
        extra_body=extra,
    )  # fmt: skip
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in routed if c.choices)
    else:
        text = routed.choices[0].message.content
    assert text == plain.choices[0].message.content and "Paris" in text


def test_completions_accept_the_same_fields(cadence_server: RunningServer) -> None:
    completion = client_for(cadence_server).completions.create(
        model=cadence_server.model,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        extra_body={k: v for k, v in ROUTER_FIELDS.items() if k != "add_generation_prompt"},
    )
    assert completion.choices[0].text


def test_an_unknown_field_is_ignored_and_logged(cadence_server: RunningServer) -> None:
    body = {"prompt": "Hello", "max_tokens": 2, "temprature": 0.5, "x_router_hint": {"a": 1}}
    response = httpx.post(f"{cadence_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        logged = [
            e
            for e in cadence_server.log_events("request.fields_ignored")
            if e["request_id"] == request_id
        ]
        if logged:
            break
        time.sleep(0.1)
    assert logged and logged[0]["fields"] == ["temprature", "x_router_hint"]
    assert logged[0]["level"] == "warning"


def test_skip_special_tokens_false_keeps_the_end_of_turn_token_in_the_text(
    cadence_server: RunningServer,
) -> None:
    answers = {}
    for skip in (True, False):
        reply = client_for(cadence_server).chat.completions.create(
            model=cadence_server.model,
            messages=QUESTION,
            max_tokens=40,
            temperature=0,
            extra_body={"skip_special_tokens": skip},
        )
        answers[skip] = reply.choices[0]
    assert answers[True].finish_reason == answers[False].finish_reason == "stop"
    assert answers[False].message.content == answers[True].message.content + "<|im_end|>"


def test_unknown_field_names_are_logged_cut_short(cadence_server: RunningServer) -> None:
    """A 1 MB field name, and 10,000 short ones, make a short log line, not a 1 MB one."""
    body = {"prompt": "Hello", "max_tokens": 1, "k" * 1_000_000: 1}
    body |= {f"extra_{i}": i for i in range(10_000)}
    response = httpx.post(f"{cadence_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    line = next(
        raw
        for raw in cadence_server.log_file.read_bytes().splitlines()
        if b"request.fields_ignored" in raw and request_id.encode() in raw
    )
    assert len(line) < 4096
    logged = orjson.loads(line)
    assert logged["count"] == 10_001 and len(logged["fields"]) == 16
    assert max(map(len, logged["fields"])) <= 64 + 3
