"""A list `prompt` in /v1/completions on a real server, as vLLM serves it: one choice per
prompt and `n`, indexed across the prompts (prompt i's choice j is i x n + j), each as the
prompt alone would get it, whole and streamed, with echo and best_of; usage counts every
prompt."""

from __future__ import annotations

import openai
import pytest

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
PROMPTS = ["The capital of France is", [2705, 28, 827, 28]]  # a text, and "One, two,"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(cadence_server: RunningServer) -> openai.OpenAI:
    url = f"{cadence_server.url}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, prompt, **fields):
    return client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, **fields
    )


def test_each_prompt_gets_its_own_choices_indexed_across_prompts(client: openai.OpenAI) -> None:
    alone = [complete(client, p, temperature=0, echo=True) for p in PROMPTS]
    batch = complete(client, PROMPTS, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    echoed = [a.choices[0].text for a in alone]
    assert [c.text for c in batch.choices] == [  # the same answers without the prompts
        e.removeprefix(p)
        for p, e in zip(("The capital of France is", "One, two,"), echoed, strict=True)
        for _ in "ab"
    ]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 4 * MAX_TOKENS

    texts = ["", "", "", ""]
    usage = None
    stream = complete(
        client,
        PROMPTS,
        temperature=0,
        n=2,
        stream=True,
        echo=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [e for e in echoed for _ in "ab"]  # each choice echoes its own prompt
    assert usage.prompt_tokens == batch.usage.prompt_tokens


def test_best_of_applies_to_each_prompt(client: openai.OpenAI) -> None:
    best = complete(client, PROMPTS, temperature=1.0, seed=3, best_of=3, n=1)
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 6 * MAX_TOKENS  # every sequence generated counts
