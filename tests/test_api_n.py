"""`n` and `best_of` on a real server with the official client: n choices, greedy ones the
same and seeded ones different and reproducible, streamed with their index; the n sequences
share the prompt's KV blocks; best_of returns the most likely of its sequences."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
PROMPT = "Once upon a time, in a small village by the sea,"
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")


def test_greedy_choices_are_identical_and_usage_counts_them_all(
    cadence_server: RunningServer,
) -> None:
    reply = client(cadence_server).completions.create(
        model=cadence_server.model, prompt=PROMPT, n=3, max_tokens=12, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) == 1 and reply.choices[0].text
    alone = client(cadence_server).completions.create(
        model=cadence_server.model, prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert reply.choices[0].text == alone.choices[0].text
    assert reply.usage.completion_tokens == 3 * alone.usage.completion_tokens
    assert reply.usage.prompt_tokens == alone.usage.prompt_tokens


def test_seeded_choices_differ_and_are_reproducible(cadence_server: RunningServer) -> None:
    def ask() -> list[str]:
        reply = client(cadence_server).chat.completions.create(
            model=cadence_server.model, messages=CHAT, n=3, max_tokens=16, temperature=1.0, seed=5
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        return [c.message.content for c in reply.choices]

    first = ask()
    assert len(set(first)) == 3
    assert ask() == first


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_choices_carry_their_index_and_equal_the_whole_ones(
    cadence_server: RunningServer, kind: str
) -> None:
    settings = dict(model=cadence_server.model, n=3, max_tokens=16, temperature=0.8, seed=11)
    api = client(cadence_server)
    if kind == "chat":
        reply = api.chat.completions.create(**settings, messages=CHAT)
        whole = [c.message.content for c in reply.choices]
        chunks = api.chat.completions.create(
            **settings, messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
    else:
        reply = api.completions.create(**settings, prompt=PROMPT)
        whole = [c.text for c in reply.choices]
        chunks = api.completions.create(
            **settings, prompt=PROMPT, stream=True, stream_options={"include_usage": True}
        )
    texts, finished, usage = ["", "", ""], [], None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if kind == "chat" else choice.text
            if choice.finish_reason is not None:
                finished.append(choice.index)
    assert texts == whole and len(set(whole)) == 3
    assert sorted(finished) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens


def test_the_n_sequences_share_the_prompts_blocks(cadence_server: RunningServer) -> None:
    """The sequences after the first start from its cached prompt blocks: at the peak the
    request holds about one prompt's blocks, not n."""
    prompt = " ".join(f"Line {i}: the tide comes in and goes out again." for i in range(60))
    before = cadence_server.wait_idle()["prefix_cache"]["hits_tokens"]
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, cadence_server.admin_state()["kv_blocks_used"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        reply = client(cadence_server).completions.create(
            model=cadence_server.model,
            prompt=prompt,
            n=4,
            max_tokens=48,
            temperature=1.0,
            seed=3,
            extra_body={"ignore_eos": True},
        )
    finally:
        done.set()
        watcher.join()
    state = cadence_server.wait_idle()
    prompt_tokens = reply.usage.prompt_tokens
    prompt_blocks = -(-prompt_tokens // 16)
    assert prompt_tokens > 700 and reply.usage.completion_tokens == 4 * 48
    assert prompt_blocks < peak < 1.5 * prompt_blocks  # n separate requests: about 4x
    # each of the 3 later sequences found every full block of the prompt but the last token's
    hits = state["prefix_cache"]["hits_tokens"] - before
    assert hits >= 3 * ((prompt_tokens - 1) // 16) * 16


def test_best_of_returns_the_most_likely_of_its_sequences(cadence_server: RunningServer) -> None:
    """best_of=3 runs the same three seeded sequences as n=3 (seed, seed + 1, seed + 2)."""
    settings = dict(
        model=cadence_server.model, prompt=PROMPT, max_tokens=10, temperature=1.2, seed=8
    )
    every = client(cadence_server).completions.create(**settings, n=3, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client(cadence_server).completions.create(**settings, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # none were asked for
    assert best.choices[0].text == every.choices[totals.index(max(totals))].text
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all three ran
    two = client(cadence_server).completions.create(**settings, n=2, best_of=3, logprobs=0)
    ranked = sorted(range(3), key=lambda i: totals[i], reverse=True)[:2]
    assert [c.text for c in two.choices] == [every.choices[i].text for i in ranked]
    assert [c.index for c in two.choices] == [0, 1]


def test_best_of_above_n_cannot_be_streamed(cadence_server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(cadence_server).completions.create(
            model=cadence_server.model, prompt=PROMPT, best_of=2, stream=True
        )
    assert info.value.body["param"] == "best_of"


def test_echoing_sequences_share_the_prompts_log_probabilities_and_blocks(
    cadence_server: RunningServer,
) -> None:
    """The prompt's log-probabilities are computed once, by the first sequence: the others
    take them and start from its cached blocks."""
    prompt = " ".join(f"Verse {i}: waves fold over the stones." for i in range(30))
    before = cadence_server.wait_idle()["prefix_cache"]["hits_tokens"]
    reply = client(cadence_server).completions.create(
        model=cadence_server.model, prompt=prompt, n=3, max_tokens=4, temperature=0,
        echo=True, logprobs=1,
    )  # fmt: skip
    hits = cadence_server.wait_idle()["prefix_cache"]["hits_tokens"] - before
    first, *others = [c.logprobs for c in reply.choices]
    prompt_tokens = reply.usage.prompt_tokens
    assert first.token_logprobs[0] is None and len(first.tokens) == prompt_tokens + 4
    for other in others:
        assert other.tokens == first.tokens
        assert other.token_logprobs[:prompt_tokens] == first.token_logprobs[:prompt_tokens]
    assert hits >= 2 * ((prompt_tokens - 1) // 16) * 16
