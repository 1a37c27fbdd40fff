"""Log-probabilities on a real server (float32), checked against transformers on the same
weights: chat's `top_logprobs`, completions' `logprobs: k`, and `echo` (the prompt's
tokens with theirs, as evaluation harnesses score answers), streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer
from tests.server_fixtures import RunningServer, cache_dir

pytestmark = pytest.mark.real_model
TOLERANCE = 2e-3  # float32 on both sides; kernels sum in other orders
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    path = resolve_model(None, cache_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, Tokenizer.from_dir(path)


def log_softmax_at_each_position(model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row p is the distribution of the token at p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")


def tokenize(server: RunningServer, body: dict) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]


def test_chat_top_logprobs_are_log_softmax_of_the_models_logits(
    cadence_server: RunningServer, reference
) -> None:
    model, tokenizer = reference
    reply = client(cadence_server).chat.completions.create(
        model=cadence_server.model,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 12
    prompt = tokenize(cadence_server, {"messages": CHAT})
    # greedy: each chosen token is the best alternative, whose id the reference names
    generated = []
    for position, entry in enumerate(content):
        expected = log_softmax_at_each_position(model, prompt + generated)[-1]
        best = expected.topk(5)
        assert [alt.token for alt in entry.top_logprobs] == [
            tokenizer.decode([i], skip_special_tokens=False) for i in best.indices.tolist()
        ], f"position {position}"
        got = torch.tensor([alt.logprob for alt in entry.top_logprobs])
        assert (got - best.values).abs().max() < TOLERANCE, f"position {position}"
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        generated.append(int(best.indices[0]))


def test_streamed_chat_logprobs_equal_the_whole_answers(cadence_server: RunningServer) -> None:
    settings = dict(
        model=cadence_server.model,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = client(cadence_server).chat.completions.create(**settings)
    streamed = []
    for chunk in client(cadence_server).chat.completions.create(**settings, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, [a.token for a in e.top_logprobs]) for e in streamed] == [
        (e.token, [a.token for a in e.top_logprobs]) for e in whole.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == pytest.approx(
        [e.logprob for e in whole.choices[0].logprobs.content], abs=1e-5
    )


def test_completion_logprobs_list_the_k_best_and_the_chosen_token(
    cadence_server: RunningServer, reference
) -> None:
    model, tokenizer = reference
    prompt = tokenizer.encode(PROMPT)
    reply = client(cadence_server).completions.create(
        model=cadence_server.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=4
    )
    found = reply.choices[0].logprobs
    assert len(found.tokens) == len(found.top_logprobs) == 6
    generated: list[int] = []
    for position, alternatives in enumerate(found.top_logprobs):
        expected = log_softmax_at_each_position(model, prompt + generated)[-1]
        best = expected.topk(4)
        pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in best.indices.tolist()]
        assert list(alternatives) == pieces, f"position {position}"  # the chosen one is the best
        got = torch.tensor([alternatives[p] for p in pieces])
        assert (got - best.values).abs().max() < TOLERANCE
        generated.append(int(best.indices[0]))
    assert found.text_offset[0] == 0 and found.text_offset[1] == len(found.tokens[0])


def test_sampled_completion_logprobs_include_the_chosen_token(
    cadence_server: RunningServer,
) -> None:
    reply = client(cadence_server).completions.create(
        model=cadence_server.model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=1.5,
        seed=7,
        logprobs=1,
    )
    found = reply.choices[0].logprobs
    for token, logprob, alternatives in zip(
        found.tokens, found.token_logprobs, found.top_logprobs, strict=True
    ):
        assert alternatives[token] == pytest.approx(logprob)
        assert 1 <= len(alternatives) <= 2  # the best, and the chosen one when it differs
        assert logprob <= max(alternatives.values()) + 1e-6


@pytest.mark.parametrize("stream", [False, True])
def test_echo_returns_the_prompt_with_the_log_probabilities_of_its_tokens(
    cadence_server: RunningServer, reference, stream: bool
) -> None:
    """A prompt longer than a step's token budget (512) is computed in chunks; it is also
    in the prefix cache already (sent once before), which echo must not use."""
    model, tokenizer = reference
    prompt_text = " ".join(f"{PROMPT} Rome, of Spain Madrid, number {i}." for i in range(40))
    prompt = tokenizer.encode(prompt_text)
    assert len(prompt) > 600
    settings = dict(model=cadence_server.model, prompt=prompt_text, max_tokens=2, temperature=0)
    client(cadence_server).completions.create(**settings)  # fills the prefix cache
    text, tokens, token_logprobs, top, offsets = "", [], [], [], []
    if stream:
        for chunk in client(cadence_server).completions.create(
            **settings, echo=True, logprobs=2, stream=True
        ):
            if chunk.choices:
                text += chunk.choices[0].text
                if chunk.choices[0].logprobs:
                    found = chunk.choices[0].logprobs
                    tokens += found.tokens
                    token_logprobs += found.token_logprobs
                    top += found.top_logprobs
                    offsets += found.text_offset
    else:
        reply = client(cadence_server).completions.create(**settings, echo=True, logprobs=2)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        found = reply.choices[0].logprobs
        text, tokens, token_logprobs = reply.choices[0].text, found.tokens, found.token_logprobs
        top, offsets = found.top_logprobs, found.text_offset
    assert text.startswith(prompt_text) and len(text) > len(prompt_text)
    assert len(tokens) == len(prompt) + 2
    assert tokens[: len(prompt)] == [
        tokenizer.decode([i], skip_special_tokens=False) for i in prompt
    ]
    assert token_logprobs[0] is None and top[0] is None
    expected = log_softmax_at_each_position(model, prompt)
    wanted = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor(token_logprobs[1 : len(prompt)])
    assert (got - wanted).abs().max() < TOLERANCE
    best = expected[:-1].topk(2, dim=-1).indices.tolist()
    for position in (1, 300, 599, len(prompt) - 1):  # either side of the chunk boundary
        pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in best[position - 1]]
        assert set(pieces) <= set(top[position]), f"position {position}"
    assert offsets[0] == 0 and offsets[len(prompt)] == len(prompt_text)


def test_echo_without_logprobs_prefixes_the_prompt(cadence_server: RunningServer) -> None:
    reply = client(cadence_server).completions.create(
        model=cadence_server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    plain = client(cadence_server).completions.create(
        model=cadence_server.model, prompt=PROMPT, max_tokens=3, temperature=0
    )
    assert reply.choices[0].text == PROMPT + plain.choices[0].text
    assert reply.choices[0].logprobs is None
