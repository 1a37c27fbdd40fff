"""One request must not freeze every stream: issue 29's attacks on the event loop, each
sent beside a live streamed chat whose largest gap between tokens is measured.

Each attack is refused with a 400 naming its field, before the per-token or per-id work it
asked for would run on the loop, and the stream beside it keeps its pace (the issue's goal:
no gap over 2 s). Before issue 29 the first two froze such a stream for seconds and got 200.

Structured output with a grammar whose masks are slow to fill (a bounded repetition: some
15 ms a row on this vocabulary, xgrammar issue #852) is served, and the stream beside its
64 constrained rows keeps its pace: under 2 s and under 10x its median gap. When the
scheduler filled every constrained row's mask in each step, that step took over a second.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
import trio

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
GAP_GOAL_S = 2.0  # the goal for the largest gap of a stream during an attack
BYTE_LEVEL_CHARS = 650_000  # U+10FFFD: 4 tokens a character, 2.6 MB of JSON
TOKENS_AFTER_ATTACK = 5  # the stream is read on this far after the attack ended
TOKENS_BEFORE_ATTACK = 20  # the stream's own pace on this machine now, before the attack


@dataclass(slots=True)
class Attack:
    method: str
    path: str
    body: dict
    param: str
    copies: int = 1


def attacks(window: int) -> dict[str, Attack]:
    byte_level = "\U0010fffd" * BYTE_LEVEL_CHARS
    return {
        # ~5.5 M log-probability entries: 32 x 21 x (8,191 + 1), a 140 MB answer
        "echo_logprobs_n": Attack(
            "POST",
            "/v1/completions",
            {
                "prompt": [1000] * (window - 1),
                "max_tokens": 1,
                "echo": True,
                "logprobs": 20,
                "n": 32,
            },
            "logprobs",
        ),
        # ~2.6 M tokens each, once decoded token by token on the loop (return_token_strs)
        "tokenize_byte_level": Attack(
            "POST", "/tokenize", {"prompt": byte_level, "return_token_strs": True}, "prompt", 2
        ),
        "detokenize_two_million": Attack(
            "POST", "/detokenize", {"tokens": [1] * 2_000_000}, "tokens"
        ),
        "completion_byte_level": Attack(
            "POST", "/v1/completions", {"prompt": byte_level, "max_tokens": 1}, "prompt"
        ),
        "chat_of_empty_messages": Attack(
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": ""}] * 130_000, "max_tokens": 1},
            "messages",
        ),
    }


async def stream_chat(client: httpx.AsyncClient, model: str, arrivals: list[float]) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                arrivals.append(time.monotonic())


@dataclass(slots=True)
class Pace:
    before: float  # the stream's largest gap before the attack
    before_median: float  # ... its median gap then
    largest: float  # ... while it ran, to a few tokens after
    median: float  # ... the median gap then


async def during_a_stream(
    server: RunningServer, attack: Callable[[httpx.AsyncClient], Awaitable[list[httpx.Response]]]
) -> tuple[Pace, list[httpx.Response]]:
    """The pace of a streamed chat before and while `attack` runs, and the attack's answers."""
    arrivals: list[float] = []

    async def tokens(count: int) -> int:
        while len(arrivals) < count:
            await trio.sleep(0.02)
        return len(arrivals)

    client = httpx.AsyncClient(base_url=server.url, timeout=300)
    with collector_paused():
        async with client, trio.open_nursery() as nursery:
            nursery.start_soon(stream_chat, client, server.model, arrivals)
            begin = await tokens(TOKENS_BEFORE_ATTACK) - 1
            answers = await attack(client)
            await tokens(len(arrivals) + TOKENS_AFTER_ATTACK)
            nursery.cancel_scope.cancel()
    before = gaps_of(arrivals[1 : begin + 1])
    during = gaps_of(arrivals[begin:])
    return Pace(before[-1], median(before), during[-1], median(during)), answers


def median(gaps: list[float]) -> float:
    return gaps[len(gaps) // 2]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The measuring client's garbage collector held off while it times a stream: a full
    collection of a whole test run's heap is a pause of the client's, not the server's."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def gaps_of(times: list[float]) -> list[float]:
    return sorted(b - a for a, b in itertools.pairwise(times))


@pytest.mark.parametrize(
    "name",
    [
        "echo_logprobs_n",
        "tokenize_byte_level",
        "detokenize_two_million",
        "completion_byte_level",
        "chat_of_empty_messages",
    ],
)
async def test_an_attack_is_refused_and_the_stream_beside_it_keeps_its_pace(
    cadence_server: RunningServer, name: str
) -> None:
    window = httpx.get(f"{cadence_server.url}/v1/models", timeout=10).json()["data"][0]
    attack = attacks(window["max_model_len"])[name]

    # encoded before the stream starts: the client's own work must not count as a gap
    content = orjson.dumps(attack.body)
    headers = {"Content-Type": "application/json"}

    async def send_copies(client: httpx.AsyncClient) -> list[httpx.Response]:
        answers: list[httpx.Response] = []

        async def send() -> None:
            answer = await client.request(
                attack.method, attack.path, content=content, headers=headers
            )
            answers.append(answer)

        async with trio.open_nursery() as nursery:
            for _ in range(attack.copies):
                nursery.start_soon(send)
        return answers

    pace, answers = await during_a_stream(cadence_server, send_copies)
    statuses = [a.status_code for a in answers]
    print(
        f"{name}: {statuses}, largest gap {pace.largest:.3f} s (median {pace.median:.3f} s, "
        f"largest before {pace.before:.3f} s)"
    )
    for answer in answers:
        assert answer.status_code == 400, answer.text[:500]
        assert answer.json()["error"]["param"] == attack.param
    # the goal beyond the stream's own worst gap here and now: a loaded machine's noise
    # is not the attack's, a freeze of seconds is
    assert pace.largest < GAP_GOAL_S + pace.before


# a JSON string: every mask after its opening quote walks the vocabulary against a
# 500-fold repetition
SLOW_GRAMMAR = {
    "type": "json_schema",
    "json_schema": {"name": "slow", "schema": {"type": "string", "pattern": '^[^"]{0,500}$'}},
}
CONSTRAINED_REQUESTS = 2  # of n = 32 each: 64 constrained rows at once
CONSTRAINED_TOKENS = 2  # the opening quote, then one whose mask is slow
# two full blocks and one token: the 31 siblings of a request compute one token each, so
# no long prefill step beside the stream measures anything but the masks
PROMPT_TOKENS = 33


async def test_constrained_rows_with_slow_masks_leave_a_free_stream_its_pace(
    cadence_server: RunningServer,
) -> None:
    text = "Describe the sea, the ships, the wind and the gulls that follow the boats home. " * 3
    ids = httpx.post(f"{cadence_server.url}/tokenize", json={"prompt": text}, timeout=30)
    prompt = ids.json()["tokens"][:PROMPT_TOKENS]

    def completion(n: int, max_tokens: int) -> bytes:
        return orjson.dumps(
            {
                "model": cadence_server.model,
                "prompt": prompt,
                "response_format": SLOW_GRAMMAR,
                "max_tokens": max_tokens,
                "n": n,
                "temperature": 0.8,
            }
        )

    headers = {"Content-Type": "application/json"}
    warm = httpx.post(
        f"{cadence_server.url}/v1/completions",
        content=completion(1, 1),
        headers=headers,
        timeout=60,
    )
    assert warm.status_code == 200, warm.text[:500]  # compiled and cached before the stream
    content = completion(32, CONSTRAINED_TOKENS)

    async def constrained(client: httpx.AsyncClient) -> list[httpx.Response]:
        answers: list[httpx.Response] = []

        async def send() -> None:
            answers.append(await client.post("/v1/completions", content=content, headers=headers))

        async with trio.open_nursery() as nursery:
            for _ in range(CONSTRAINED_REQUESTS):
                nursery.start_soon(send)
        return answers

    started = time.monotonic()
    pace, answers = await during_a_stream(cadence_server, constrained)
    print(
        f"slow grammar x {32 * CONSTRAINED_REQUESTS} rows: {[a.status_code for a in answers]}, "
        f"largest gap {pace.largest:.3f} s (median {pace.median:.3f} s; before: median "
        f"{pace.before_median:.3f} s, largest {pace.before:.3f} s), "
        f"{time.monotonic() - started:.1f} s in all"
    )
    for answer in answers:
        assert answer.status_code == 200, answer.text[:500]
        choices = answer.json()["choices"]
        assert len(choices) == 32 and all(c["text"].lstrip().startswith('"') for c in choices)
    assert pace.largest < GAP_GOAL_S + pace.before  # as above: a loaded machine's noise
    # the discriminating bound: filled in each step, the 64 masks made one gap ~30 medians
    assert pace.largest < 10 * pace.median
