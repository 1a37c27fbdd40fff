"""The one validation of a request, alone: each rule at its edges, and the field it names.

tests/test_engine_basic.py checks that the engine runs it at admission; the HTTP tests
(tests/test_api_errors.py) see the same errors as 400s in OpenAI's shape.
"""

from __future__ import annotations

import math

import pytest

from gpu_worker.protocol import SamplingSpec
from service.engine.request import SamplingParams
from service.engine.validation import (
    MAX_DEADLINE_S,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_SEED,
    MAX_SEQUENCES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TENANT_CHARS,
    InvalidRequest,
    Limits,
    validate,
)

LIMITS = Limits(vocab_size=100, max_model_len=64, kv_capacity_tokens=48)


def params(max_tokens: int | None = 4, stop: list | None = None, **sampling) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, stop=stop or [], sampling=SamplingSpec(**sampling))


def check(
    prompt=(1, 2), p: SamplingParams | None = None, tenant="t", priority=0, n=1, deadline=None
) -> None:
    validate(
        list(prompt), p or params(), LIMITS, tenant, priority, sequences=n, deadline_s=deadline
    )


def refusal(**kw) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        check(**kw)
    return info.value


@pytest.mark.parametrize(
    ("kw", "param", "code"),
    [
        ({"prompt": ()}, "prompt", None),
        ({"prompt": (1, 100)}, "prompt", None),
        ({"prompt": (1, -1)}, "prompt", None),
        ({"prompt": (1, True)}, "prompt", None),
        ({"prompt": (1, 2.0)}, "prompt", None),
        ({"p": params(temperature=-0.001)}, "temperature", None),
        ({"p": params(temperature=2.001)}, "temperature", None),
        ({"p": params(temperature=math.inf)}, "temperature", None),
        ({"p": params(temperature=True)}, "temperature", None),
        ({"p": params(top_p=0.0)}, "top_p", None),
        ({"p": params(top_p=1.0001)}, "top_p", None),
        ({"p": params(top_p=math.nan)}, "top_p", None),
        ({"p": params(top_k=-1)}, "top_k", None),
        ({"p": params(top_k=1.5)}, "top_k", None),
        ({"p": params(seed=-1)}, "seed", None),
        ({"p": params(seed=MAX_SEED + 1)}, "seed", None),
        ({"p": params(seed=True)}, "seed", None),
        ({"p": params(max_tokens=0)}, "max_tokens", None),
        ({"p": params(max_tokens=True)}, "max_tokens", None),
        ({"p": params(stop=[""])}, "stop", None),
        ({"p": params(stop=[1])}, "stop", None),
        ({"p": params(stop=["a"] * (MAX_STOP_STRINGS + 1))}, "stop", None),
        ({"p": params(stop=["a", "b" * (MAX_STOP_CHARS + 1)])}, "stop", None),
        ({"p": params(presence_penalty=2.001)}, "presence_penalty", None),
        ({"p": params(frequency_penalty=-2.001)}, "frequency_penalty", None),
        ({"p": params(frequency_penalty=math.nan)}, "frequency_penalty", None),
        ({"p": params(repetition_penalty=0.0)}, "repetition_penalty", None),
        ({"p": params(min_p=1.001)}, "min_p", None),
        ({"p": params(min_p=-0.1)}, "min_p", None),
        ({"p": params(logit_bias=[(100, 1.0)])}, "logit_bias", None),
        ({"p": params(logit_bias=[(3, 100.5)])}, "logit_bias", None),
        ({"p": params(logit_bias=[(3, -101.0)])}, "logit_bias", None),
        ({"p": params(allowed_token_ids=[])}, "allowed_token_ids", None),
        ({"p": params(allowed_token_ids=[5, 100])}, "allowed_token_ids", None),
        ({"p": params(min_tokens=-1)}, "min_tokens", None),
        ({"p": params(min_tokens=5)}, "min_tokens", None),  # more than max_tokens (4)
        ({"p": SamplingParams(stop_token_ids=[100])}, "stop_token_ids", None),
        ({"p": SamplingParams(stop_token_ids=[True])}, "stop_token_ids", None),
        ({"p": SamplingParams(bad_words=[" "])}, "bad_words", None),
        ({"p": SamplingParams(bad_words=["a"] * 65)}, "bad_words", None),
        ({"tenant": ""}, "user", None),
        ({"tenant": "t" * (MAX_TENANT_CHARS + 1)}, "user", None),
        ({"priority": MAX_PRIORITY + 1}, "priority", None),
        ({"priority": -MAX_PRIORITY - 1}, "priority", None),
        ({"priority": 1.0}, "priority", None),
        ({"n": 0}, "n", None),
        ({"n": MAX_SEQUENCES + 1}, "n", None),
        ({"n": 2.0}, "n", None),
        ({"deadline": 0.0}, "deadline_s", None),
        ({"deadline": -1}, "deadline_s", None),
        ({"deadline": MAX_DEADLINE_S * 1.001}, "deadline_s", None),
        ({"deadline": math.nan}, "deadline_s", None),
        ({"p": params(logprobs=True, top_logprobs=MAX_LOGPROBS + 1)}, "top_logprobs", None),
        ({"p": params(top_logprobs=-1)}, "top_logprobs", None),
        ({"p": params(prompt_logprobs=MAX_LOGPROBS + 1)}, "prompt_logprobs", None),
        ({"prompt": [1] * 60, "p": params(max_tokens=5)}, "max_tokens", "context_length_exceeded"),
        ({"prompt": [1] * 40, "p": params(max_tokens=9)}, "max_tokens", "kv_capacity_exceeded"),
    ],
)
def test_each_rule_names_its_field(kw, param, code):
    error = refusal(**kw)
    assert (error.param, error.code) == (param, code)
    assert str(error)


@pytest.mark.parametrize(
    "kw",
    [
        {"p": params(temperature=0.0, top_p=1.0, top_k=0, seed=0)},
        {"p": params(temperature=2.0, top_p=1e-9, top_k=10**9, seed=MAX_SEED)},
        {"p": params(temperature=1, stop=["a"] * MAX_STOP_STRINGS)},  # an int temperature
        {"p": params(stop=["€" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)},  # characters, not bytes
        {"prompt": [99, 0]},  # the vocabulary's ends
        {"tenant": "t" * MAX_TENANT_CHARS, "priority": MAX_PRIORITY},
        {"priority": -MAX_PRIORITY},
        {"n": MAX_SEQUENCES, "deadline": MAX_DEADLINE_S},
        {"n": 1, "deadline": 1e-3},
        {"p": params(logprobs=True, top_logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS)},
        {"p": params(logprobs=True, top_logprobs=0, prompt_logprobs=0)},
        {"prompt": [1] * 40, "p": params(max_tokens=8)},  # exactly the KV capacity
    ],
)
def test_the_edges_of_every_range_are_accepted(kw):
    check(**kw)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"prompt": ()}, "the prompt is empty"),
        ({"p": params(stop=[""])}, "stop must be a list of non-empty strings"),
        ({"p": params(stop=["s" * 300])}, f"at most {MAX_STOP_CHARS} characters"),
        ({"tenant": ""}, f"tenant name must have 1 to {MAX_TENANT_CHARS} characters"),
        ({"priority": 10**7}, f"between {-MAX_PRIORITY} and {MAX_PRIORITY}"),
        ({"p": params(seed=-1)}, f"[0, {MAX_SEED}]"),
        ({"p": params(top_p=2.0)}, "(0, 1], got 2.0"),
    ],
)
def test_messages_say_what_is_allowed(kw, words):
    assert words in str(refusal(**kw))


def test_the_context_window_is_checked_before_the_kv_capacity():
    roomy = Limits(vocab_size=100, max_model_len=64, kv_capacity_tokens=1000)
    validate([1] * 60, params(max_tokens=4), roomy, "t", 0)  # exactly the window
    with pytest.raises(InvalidRequest, match="maximum context length is 64 tokens") as info:
        validate([1] * 60, params(max_tokens=5), LIMITS, "t", 0)
    assert "65 tokens (60 in the prompt, 5 in the completion). Please reduce" in str(info.value)


def test_a_missing_max_tokens_becomes_the_rest_of_the_context_window():
    roomy = Limits(vocab_size=100, max_model_len=64, kv_capacity_tokens=1000)
    p = params(max_tokens=None)
    validate([1] * 10, p, roomy, "t", 0)
    assert p.max_tokens == 54
    full = params(max_tokens=None)
    with pytest.raises(InvalidRequest) as info:
        validate([1] * 64, full, roomy, "t", 0)  # nothing left: one token is still asked for
    assert info.value.code == "context_length_exceeded" and full.max_tokens == 1


def test_the_logit_processors_accept_their_ranges_edges():
    edges = params(
        presence_penalty=-2.0,
        frequency_penalty=2,
        repetition_penalty=0.01,
        min_p=1.0,
        logit_bias=[(0, -100.0), (99, 100)],
        allowed_token_ids=[0, 99],
        min_tokens=4,
    )
    edges.stop_token_ids, edges.bad_words = [0, 99], ["word"]
    check(p=edges)
