"""The prefix cache over HTTP on the real model: a long shared prefix is computed once,
the usage reports the cached prompt tokens, /metrics and /admin/state count them, and the
admin reset forgets them."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from ops.corpus import full_text
from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
BLOCK = 16
QUESTIONS = ["Who wrote this?", "Summarise it in one line.", "What is the first word?"]


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def document(tag: str, chars: int = 6000) -> str:
    """~1,500 tokens (by default) no other test sends (the tag makes it unique from its
    first block); a test that needs only some cached blocks takes fewer, a prefill less."""
    return f"[{tag}]\n" + full_text()[:chars]


def counters(server: RunningServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    names = ("prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_blocks")
    found = {}
    for name in names:
        match = re.search(rf"^cadence:{name} (\S+)$", text, re.M)
        assert match, f"cadence:{name} missing from /metrics"
        found[name] = float(match.group(1))
    return found


def ask(server: RunningServer, prompt: str) -> tuple[str, int, int, float]:
    """Stream a greedy completion: (text, prompt tokens, cached tokens, TTFT seconds)."""
    started = time.perf_counter()
    stream = client_for(server).completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, ttft, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            ttft = ttft or time.perf_counter() - started
            text += chunk.choices[0].text
        usage = chunk.usage or usage
    assert usage is not None and ttft is not None
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, ttft


def test_a_long_shared_prefix_is_computed_once(cadence_server: RunningServer) -> None:
    before = counters(cadence_server)
    doc = document("shared-prefix")
    answers = [ask(cadence_server, f"{doc}\nQuestion: {q}\nAnswer:") for q in QUESTIONS]
    repeat = ask(cadence_server, f"{doc}\nQuestion: {QUESTIONS[0]}\nAnswer:")
    after = counters(cadence_server)
    ttfts = [round(a[3] * 1000) for a in [*answers, repeat]]
    print("TTFT ms (cold, then cached):", ttfts, "cached tokens:", [a[2] for a in answers])
    first_prompt, first_cached = answers[0][1], answers[0][2]
    assert first_prompt > 1000 and first_cached == 0
    for _, prompt_tokens, cached, _ in answers[1:]:
        # every full block of the document (its last one may hold the question's start)
        assert prompt_tokens - 3 * BLOCK <= cached < prompt_tokens
    assert repeat[0] == answers[0][0]  # the same greedy text from the cache
    assert repeat[2] == (first_prompt - 1) // BLOCK * BLOCK  # all but the last token's block
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    assert hits == sum(a[2] for a in [*answers, repeat])
    assert queries == sum(a[1] for a in [*answers, repeat])
    assert after["prefix_cache_blocks"] >= first_prompt // BLOCK


def test_chat_usage_reports_cached_tokens_streamed_and_not(cadence_server: RunningServer) -> None:
    messages = [
        {"role": "system", "content": document("chat-usage", 800)},
        {"role": "user", "content": "Say hi."},
    ]
    client = client_for(cadence_server)
    first = client.chat.completions.create(
        model=cadence_server.model, messages=messages, max_tokens=4, temperature=0
    )
    stream = client.chat.completions.create(
        model=cadence_server.model,
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BLOCK * BLOCK


def test_the_admin_state_shows_the_cache_and_the_reset_needs_the_token(
    cadence_server: RunningServer,
) -> None:
    prompt = f"{document('reset', 800)}\nAnswer:"
    ask(cadence_server, prompt)
    cache = cadence_server.admin_state()["prefix_cache"]
    assert cache["enabled"] and cache["cached_blocks"] > 0 and 0 < cache["hit_rate"] <= 1
    refused = httpx.post(f"{cadence_server.url}/reset_prefix_cache", timeout=10)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    reset = httpx.post(
        f"{cadence_server.url}/reset_prefix_cache",
        headers=cadence_server.admin_headers(),
        timeout=10,
    )
    assert reset.status_code == 200 and reset.json()["reset_blocks"] == cache["cached_blocks"]
    assert cadence_server.admin_state()["prefix_cache"]["cached_blocks"] == 0
    assert ask(cadence_server, prompt)[2] == 0  # computed again from the start
