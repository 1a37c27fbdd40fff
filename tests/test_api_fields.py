"""Every field the server's OpenAPI document accepts is honoured or refused, never dropped.

The walk reads /openapi.json and, for each generation route and the embeddings', sends each
field it lists with
a value other than its default, then checks the field's effect on the answer (CHECKS), or
its 400 naming it (a field accepted only at a neutral value, sent at another), or names the
test elsewhere that shows the effect (the effect needs a policy, a key, a parser or a load:
ELSEWHERE). A field the document gains without one of these fails the walk, so a field
cannot be accepted and ignored unnoticed (as the Responses API's were: text.format and all
but six sampling fields).

`logit_bias` is shown on token ids across the whole vocabulary (no earlier test biased an
id above 32,767, where an int16 index would have dropped it).
"""

from __future__ import annotations

import base64
import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from service.api.fields import NEUTRAL_VALUES
from service.api.responses_options import NEUTRAL as RESPONSES_NEUTRAL
from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
EOS = "2"  # SmolLM2's <|im_end|>
FORCED = "32768"  # a token id above int16's range: "bler"
ONE, TWO = 582, 827  # " one", " two"
OTHER = {"value": "cadence-not-neutral"}  # no neutral value is this


@dataclass(slots=True)
class Answer:
    status: int
    body: dict[str, Any]
    text: str
    finish: str | None
    tokens: int


ROUTES = {
    "completions": ("/v1/completions", {"prompt": "one one one one one", "max_tokens": 6}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say one one one."}], "max_tokens": 6},
    ),
    "responses": ("/v1/responses", {"input": "Say one one one.", "max_output_tokens": 6}),
    "embeddings": ("/v1/embeddings", {"input": "one one one"}),  # ids 537, 582, 582
}
# fields a route's body is made of, not options of it
STRUCTURAL = {"prompt", "messages", "input", "stream"}


def answer_of(route: str, response: httpx.Response) -> Answer:
    body = response.json()
    if response.status_code != 200:
        return Answer(response.status_code, body, "", None, 0)
    if route == "embeddings":
        return Answer(200, body, "", None, body["usage"]["prompt_tokens"])
    if route == "responses":
        text = "".join(
            part["text"]
            for item in body["output"]
            if item["type"] == "message"
            for part in item["content"]
        )
        finish = {"completed": "stop", "incomplete": "length"}[body["status"]]
        return Answer(200, body, text, finish, body["usage"]["output_tokens"])
    choice = body["choices"][0]
    text = choice["text"] if route == "completions" else choice["message"]["content"] or ""
    return Answer(200, body, text, choice["finish_reason"], body["usage"]["completion_tokens"])


Send = Callable[[dict[str, Any]], Answer]


def greedy(send: Send, **fields: Any) -> Answer:
    return send({"temperature": 0, **fields})


def sampled(send: Send, **fields: Any) -> Answer:
    return send({"temperature": 1.0, "seed": 11, **fields})


def same_as_greedy(field: str, value: Any) -> Callable[[Send], None]:
    """A cut that leaves only the most likely token: sampling then equals greedy."""

    def check(send: Send) -> None:
        assert sampled(send, **{field: value}).text == greedy(send).text

    return check


def penalized(field: str) -> Callable[[Send], None]:
    """After "x", between " one" and " two" (the latter biased down), greedy repeats
    " one"; a penalty on what was generated (2.0, the most) turns it to " two" within six
    tokens (the margin is about a unit of logit either way)."""

    def check(send: Send) -> None:
        fields = {
            "prompt": "x",
            "allowed_token_ids": [ONE, TWO],
            "logit_bias": {str(TWO): -1.5},
            "ignore_eos": True,
        }
        assert greedy(send, **fields).text == " one" * 6
        assert " two" in greedy(send, **fields, **{field: 2.0}).text

    return check


def check_accepted(field: str, value: Any) -> Callable[[Send], None]:
    """A field the chat and Responses parsers hand to the completions' own reading
    (`_parse_common`), whose effect the completions route shows."""

    def check(send: Send) -> None:
        assert send({field: value}).status == 200

    return check


def check_max_tokens(field: str) -> Callable[[Send], None]:
    def check(send: Send) -> None:
        answer = greedy(send, **{field: 2, "ignore_eos": True})
        assert answer.tokens == 2 and answer.finish == "length"

    return check


def check_seed(send: Send) -> None:
    fields = {"temperature": 1.5, "ignore_eos": True}
    first, again = send({**fields, "seed": 1}), send({**fields, "seed": 1})
    assert first.text == again.text
    assert any(send({**fields, "seed": seed}).text != first.text for seed in (2, 3, 4))


def check_temperature(send: Send) -> None:
    hot = send({"temperature": 2.0, "seed": 5, "ignore_eos": True})
    assert hot.text != greedy(send, ignore_eos=True).text


def check_logit_bias(send: Send) -> None:
    assert greedy(send, logit_bias={FORCED: 100}).text.startswith("bler")


def check_allowed(send: Send) -> None:
    assert greedy(send, allowed_token_ids=[int(FORCED)], ignore_eos=True).text == "bler" * 6


def check_stop_token_ids(send: Send) -> None:
    answer = greedy(send, logit_bias={FORCED: 100}, stop_token_ids=[int(FORCED)])
    assert answer.tokens == 1 and answer.finish == "stop"


def check_ignore_eos(send: Send) -> None:
    assert greedy(send, logit_bias={EOS: 100}).tokens == 1
    assert greedy(send, logit_bias={EOS: 100}, ignore_eos=True).tokens == 6


def check_min_tokens(send: Send) -> None:
    assert greedy(send, logit_bias={EOS: 100}, min_tokens=4).tokens >= 4


def check_skip_special(send: Send) -> None:
    fields = {"logit_bias": {EOS: 100}, "ignore_eos": True}
    assert "<|im_end|>" in greedy(send, **fields, skip_special_tokens=False).text
    assert "<|im_end|>" not in greedy(send, **fields).text


def check_stop(send: Send) -> None:
    text = greedy(send, ignore_eos=True).text
    stop = text[3:5]
    answer = greedy(send, stop=[stop], ignore_eos=True)
    assert answer.finish == "stop" and answer.text == text[: text.index(stop)]


def check_bad_words(send: Send) -> None:
    word = greedy(send).text.split()[0]
    assert word not in greedy(send, bad_words=[word]).text.split()[:1]


def check_choice(field: str, value: Any) -> Callable[[Send], None]:
    def check(send: Send) -> None:
        assert greedy(send, **{field: value}).text in ("yes", "no")

    return check


def check_regex(field: str) -> Callable[[Send], None]:
    def check(send: Send) -> None:
        assert re.fullmatch("[0-9]{3}", greedy(send, **{field: "[0-9]{3}"}).text)

    return check


def check_json(field: str, value: Any) -> Callable[[Send], None]:
    def check(send: Send) -> None:
        assert json.loads(greedy(send, **{field: value}).text) in ("yes", "no")

    return check


def check_grammar(field: str) -> Callable[[Send], None]:
    def check(send: Send) -> None:
        assert greedy(send, **{field: 'root ::= "yes" | "no"'}).text in ("yes", "no")

    return check


def check_n(send: Send) -> None:
    assert len(greedy(send, n=2).body["choices"]) == 2


def check_best_of(send: Send) -> None:
    answer = sampled(send, best_of=3, ignore_eos=True)
    assert len(answer.body["choices"]) == 1 and answer.tokens == 18


def check_echo(send: Send) -> None:
    assert greedy(send, echo=True).text.startswith("one one one one one")


def check_logprobs(send: Send) -> None:
    answer = greedy(send, logprobs=2)
    assert len(answer.body["choices"][0]["logprobs"]["tokens"]) == answer.tokens


def check_chat_logprobs(send: Send) -> None:
    answer = greedy(send, logprobs=True, top_logprobs=2)
    entries = answer.body["choices"][0]["logprobs"]["content"]
    assert len(entries) == answer.tokens and len(entries[0]["top_logprobs"]) == 2


def check_responses_logprobs(field: str, value: Any) -> Callable[[Send], None]:
    def check(send: Send) -> None:
        answer = greedy(send, **{field: value})
        (message,) = [item for item in answer.body["output"] if item["type"] == "message"]
        assert len(message["content"][0]["logprobs"]) == answer.tokens

    return check


def check_text_format(send: Send) -> None:
    fmt = {"type": "json_schema", "name": "yn", "schema": {"enum": ["yes", "no"]}}
    answer = greedy(send, text={"format": fmt}, max_output_tokens=4)
    assert json.loads(answer.text) in ("yes", "no")
    assert answer.body["text"]["format"] == fmt


def check_instructions(send: Send) -> None:
    longer = greedy(send, instructions="Answer in French, briefly and politely. " * 8)
    assert longer.body["usage"]["input_tokens"] > greedy(send).body["usage"]["input_tokens"]


def check_metadata(send: Send) -> None:
    assert greedy(send, metadata={"k": "v"}).body["metadata"] == {"k": "v"}


def check_model(send: Send) -> None:
    answer = send({"model": "gpt-17"})
    assert answer.status == 404 and answer.body["error"]["param"] == "model"


def check_refused(field: str, value: Any) -> Callable[[Send], None]:
    def check(send: Send) -> None:
        answer = send({field: value})
        assert answer.status == 400 and answer.body["error"]["param"] == field, answer.body

    return check


def check_tools(send: Send) -> None:
    tool = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    answer = greedy(
        send,
        tools=[{"type": "function", "function": tool}],
        tool_choice="required",
        max_tokens=32,
    )
    assert answer.body["choices"][0]["message"]["tool_calls"]


def vector_of(answer: Answer) -> np.ndarray:
    return np.asarray(answer.body["data"][0]["embedding"], dtype=np.float64)


def check_encoding_format(send: Send) -> None:
    packed = send({"encoding_format": "base64"}).body["data"][0]["embedding"]
    floats = np.frombuffer(base64.b64decode(packed), dtype="<f4")
    assert floats.tolist() == send({}).body["data"][0]["embedding"]


def check_normalize(send: Send) -> None:
    unit, raw = vector_of(send({})), vector_of(send({"normalize": False}))
    assert abs(np.linalg.norm(unit) - 1) < 1e-5 and abs(np.linalg.norm(raw) - 1) > 0.1
    assert np.allclose(raw / np.linalg.norm(raw), unit, atol=1e-5)


def check_truncate_prompt_tokens(send: Send) -> None:
    cut = send({"truncate_prompt_tokens": 2})
    assert cut.tokens == 2
    assert np.allclose(vector_of(cut), vector_of(send({"input": [582, 582]})), atol=1e-6)


YES_NO = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"enum": ["yes", "no"]}}}
CHECKS: dict[str, Callable[[Send], None]] = {
    # refused by a server without --kv-transfer-role; a producer and a consumer honour it
    # (tests/test_api_pd_disaggregation.py, tests/test_engine_kv_transfer.py)
    "kv_transfer_params": check_refused("kv_transfer_params", {"do_remote_decode": True}),
    "model": check_model,
    "max_tokens": check_max_tokens("max_tokens"),
    "max_completion_tokens": check_max_tokens("max_completion_tokens"),
    "max_output_tokens": check_max_tokens("max_output_tokens"),
    "temperature": check_temperature,
    "top_p": same_as_greedy("top_p", 1e-9),
    "top_k": same_as_greedy("top_k", 1),
    "min_p": same_as_greedy("min_p", 1.0),
    "seed": check_seed,
    "presence_penalty": check_accepted("presence_penalty", 2.0),
    "frequency_penalty": check_accepted("frequency_penalty", 2.0),
    "repetition_penalty": check_accepted("repetition_penalty", 2.0),
    "logit_bias": check_logit_bias,
    "allowed_token_ids": check_allowed,
    "stop_token_ids": check_stop_token_ids,
    "ignore_eos": check_ignore_eos,
    "min_tokens": check_min_tokens,
    "skip_special_tokens": check_skip_special,
    "stop": check_stop,
    "bad_words": check_bad_words,
    "n": check_n,
    "best_of": check_best_of,
    "response_format": check_json("response_format", YES_NO),
    "guided_json": check_json("guided_json", {"enum": ["yes", "no"]}),
    "json_schema": check_json("json_schema", {"enum": ["yes", "no"]}),
    "guided_choice": check_choice("guided_choice", ["yes", "no"]),
    "structured_outputs": check_choice("structured_outputs", {"choice": ["yes", "no"]}),
    "guided_regex": check_regex("guided_regex"),
    "regex": check_regex("regex"),
    "guided_grammar": check_grammar("guided_grammar"),
    "ebnf": check_grammar("ebnf"),
    "text": check_text_format,
    "instructions": check_instructions,
    "tools": check_tools,
    "tool_choice": check_tools,
    # the default server takes no request's own template
    "chat_template": check_refused("chat_template", "{{ messages }}"),
}
ROUTE_CHECKS: dict[tuple[str, str], Callable[[Send], None]] = {
    ("completions", "logprobs"): check_logprobs,
    ("completions", "echo"): check_echo,
    ("chat", "echo"): check_refused("echo", True),
    ("completions", "presence_penalty"): penalized("presence_penalty"),
    ("completions", "frequency_penalty"): penalized("frequency_penalty"),
    ("completions", "repetition_penalty"): penalized("repetition_penalty"),
    ("responses", "metadata"): check_metadata,
    ("chat", "logprobs"): check_chat_logprobs,
    ("chat", "top_logprobs"): check_chat_logprobs,
    ("responses", "top_logprobs"): check_responses_logprobs("top_logprobs", 2),
    ("responses", "include"): check_responses_logprobs("include", ["message.output_text.logprobs"]),
    ("responses", "tools"): check_refused("tools", "not a list"),  # shown on the tools server
    ("responses", "tool_choice"): check_refused("tool_choice", "sometimes"),
    ("embeddings", "encoding_format"): check_encoding_format,
    ("embeddings", "normalize"): check_normalize,
    ("embeddings", "truncate_prompt_tokens"): check_truncate_prompt_tokens,
}
# field -> the test that shows its effect, which needs what this server lacks
ELSEWHERE = {
    "user": "test_api_keys::test_a_requests_tenant_is_its_keys",
    "safety_identifier": "test_api_keys::test_a_requests_tenant_is_its_keys",
    "priority": "test_api_priority::test_lower_priority_values_run_first_as_vllm_does",
    "deadline_ms": "test_api_deadlines::"
    "test_a_request_that_cannot_start_by_its_deadline_is_refused_and_streams_go_on",
    "cache_salt": "test_api_keys::test_the_prefix_cache_is_shared_within_a_tenant_never_across",
    "stream_options": "test_api_tools::test_continuous_usage_stats_count_every_chunk",
    "parallel_tool_calls": "test_api_tools::test_parallel_tool_calls_false_makes_one_call",
    "chat_template_kwargs": "test_api_tools::"
    "test_reasoning_opened_by_the_template_is_reasoning_content",
    "reasoning_effort": "test_api_chat_options::"
    "test_reasoning_effort_and_kwargs_are_template_variables",
    "reasoning": "test_api_chat_options::test_reasoning_effort_and_kwargs_are_template_variables",
    "thinking_token_budget": "test_api_tools::"
    "test_a_grammar_starts_after_the_reasoning_whole_and_streamed",
    "include_reasoning": "test_api_reasoning_parser::"
    "test_include_reasoning_false_leaves_the_reasoning_out_whole_and_streamed",
    # the default model's tokenizer adds no special token
    "add_special_tokens": "test_api_embeddings::test_add_special_tokens_reaches_the_tokenizer",
}


# non-default values of the fields whose effect another test shows
VALUES = {
    "user": "walker",
    "safety_identifier": "walker",
    "priority": 1,
    "deadline_ms": 60_000,
    "cache_salt": "walk",
    "parallel_tool_calls": False,
    "chat_template_kwargs": {"enable_thinking": True},
    "reasoning_effort": "low",
    "reasoning": {"effort": "low"},
    "include_reasoning": False,
    "add_special_tokens": False,
}


def fields_of(document: dict, path: str) -> list[str]:
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return sorted(set(body["schema"]["properties"]) - STRUCTURAL)


def neutral_of(route: str) -> dict[str, tuple]:
    if route == "responses":  # its own, and the chat's it hands on
        return NEUTRAL_VALUES | {name: allowed for name, (allowed, _) in RESPONSES_NEUTRAL.items()}
    return NEUTRAL_VALUES


@pytest.fixture(scope="module")
def document(cadence_server: RunningServer) -> dict:
    return httpx.get(f"{cadence_server.url}/openapi.json", timeout=30).json()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_field_of_the_schema_is_honoured_or_refused(
    cadence_server: RunningServer, document: dict, route: str
) -> None:
    path, base = ROUTES[route]
    shared = fields_of(document, ROUTES["completions"][0])
    client = httpx.Client(base_url=cadence_server.url, timeout=120)

    def send(fields: dict[str, Any]) -> Answer:
        return answer_of(route, client.post(path, json={**base, **fields}))

    unclassified = []
    neutral = neutral_of(route)
    for field in fields_of(document, path):
        if route == "chat" and field in shared and (route, field) not in ROUTE_CHECKS:
            continue  # read by the same code as the completions' (_parse_common)
        check = ROUTE_CHECKS.get((route, field)) or CHECKS.get(field)
        if check is not None:
            check(send)
        elif field in ELSEWHERE:
            module, name = ELSEWHERE[field].split("::")
            assert callable(getattr(importlib.import_module(f"tests.{module}"), name))
            if field in VALUES:  # accepted here too
                assert send({field: VALUES[field]}).status == 200, field
        elif neutral.get(field):
            check_refused(field, OTHER)(send)
        else:
            unclassified.append(field)
    client.close()
    assert not unclassified, f"fields neither honoured nor refused on {route}: {unclassified}"


@pytest.mark.parametrize("token", [17, 1000, 32767, 32768, 40000, 49151])
def test_logit_bias_reaches_every_token_of_the_vocabulary(
    cadence_server: RunningServer, token: int
) -> None:
    url = cadence_server.url
    piece = httpx.post(f"{url}/detokenize", json={"tokens": [token]}, timeout=30).json()["prompt"]
    body = {
        "prompt": "Hello",
        "max_tokens": 1,
        "temperature": 0,
        "logit_bias": {str(token): 100},
        "skip_special_tokens": False,
        "logprobs": 0,
    }
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["logprobs"]["tokens"] == [piece]
