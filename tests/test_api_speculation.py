"""Speculative decoding on the real model, through the server: n-gram drafts change how
many steps a stream takes, never its tokens. A server with `--speculative-config` answers
as one without (bfloat16, the default model) greedy and seeded, alone and together, with
the same log-probabilities, and its /metrics and logs count the drafts it accepted.

The same holds with a draft model: the default model drafting for itself, a draft that is
right nearly every time, on free text too (BENCHMARKS.md measures a cheaper one, its own
Q4_1 weights: here, on a CPU without their kernel, they would be slow)."""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from ops.spec_bench import task_messages
from tests.server_fixtures import RunningServer, start_server, stop_server

pytestmark = pytest.mark.real_model
# The step-cost allowance at its widest: whether drafts are accepted must not depend on the
# step times this machine happens to measure (the simulated worker's tests cover the rule).
SPECULATIVE = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"step_cost_tolerance": 1.0}'
)
MAX_TOKENS = 96
FREE = [{"role": "user", "content": "What is the tallest mountain in Africa?"}]


DRAFT_MODEL = (
    '{"model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3, "step_cost_tolerance": 1.0}'
)


def speculating_server(log_dir, config: str) -> Iterator[RunningServer]:
    server = start_server(
        log_dir, "--speculative-config", config, "--debug-invariants", dtype="bfloat16"
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def drafting_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from speculating_server(tmp_path_factory.mktemp("speculation"), SPECULATIVE)


@pytest.fixture(scope="module")
def draft_model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from speculating_server(tmp_path_factory.mktemp("draft_model"), DRAFT_MODEL)


def chat(
    server: RunningServer, messages: list[dict], **options
) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    return client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS, **options
    )


def answer(reply) -> tuple[str, int, str]:
    choice = reply.choices[0]
    return choice.message.content, reply.usage.completion_tokens, choice.finish_reason


def accepted_tokens(server: RunningServer, counted: str = "accepted") -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    match = re.search(
        rf"^cadence:spec_decode_num_{counted}_tokens_total(?:\{{[^}}]*\}})? (\S+)$", text, re.M
    )
    assert match, f"no {counted}-tokens counter in /metrics"
    return float(match.group(1))


CHATS = [task_messages("edit", 2), task_messages("quote", 0), FREE]


@pytest.mark.parametrize("messages", CHATS, ids=["edit", "quote", "free"])
def test_greedy_answers_are_those_without_drafts(
    drafting_server: RunningServer, cadence_server_bf16: RunningServer, messages
) -> None:
    options = {"temperature": 0, "logprobs": True, "top_logprobs": 2}
    drafted = chat(drafting_server, messages, **options)
    plain = chat(cadence_server_bf16, messages, **options)
    assert answer(drafted) == answer(plain)
    for ours, theirs in zip(
        drafted.choices[0].logprobs.content, plain.choices[0].logprobs.content, strict=True
    ):
        assert ours.token == theirs.token and ours.logprob == theirs.logprob
        assert [t.token for t in ours.top_logprobs] == [t.token for t in theirs.top_logprobs]


def test_a_repetitive_answer_accepts_drafts(drafting_server: RunningServer) -> None:
    before = accepted_tokens(drafting_server)
    reply = chat(drafting_server, task_messages("edit", 2), temperature=0)
    # the code comes back verbatim (its renamed name aside): most of it from drafts
    assert accepted_tokens(drafting_server) - before >= reply.usage.completion_tokens / 3


def test_streams_together_answer_as_alone(
    drafting_server: RunningServer, cadence_server_bf16: RunningServer
) -> None:
    alone = [answer(chat(cadence_server_bf16, m, temperature=0)) for m in CHATS]
    with concurrent.futures.ThreadPoolExecutor(len(CHATS)) as pool:
        together = list(pool.map(lambda m: answer(chat(drafting_server, m, temperature=0)), CHATS))
    assert together == alone


def test_a_seeded_sampled_answer_is_the_one_without_drafts(
    drafting_server: RunningServer, cadence_server_bf16: RunningServer
) -> None:
    options = {"temperature": 0.8, "seed": 7}
    messages = task_messages("edit", 1)
    assert answer(chat(drafting_server, messages, **options)) == answer(
        chat(cadence_server_bf16, messages, **options)
    )


def test_a_stop_string_inside_accepted_drafts_ends_the_answer_there(
    drafting_server: RunningServer, cadence_server_bf16: RunningServer
) -> None:
    messages = task_messages("edit", 2)
    full = answer(chat(cadence_server_bf16, messages, temperature=0))[0]
    # a line the answer copies from its input (what drafts there are right about), from
    # this machine's own answer: which text a CPU's kernels give is theirs to choose
    asked = messages[-1]["content"]
    copied = [line.strip() for line in full.splitlines() if len(line.strip()) >= 8]
    copied = [line for line in copied if line in asked]
    assert copied, full
    stop = {"temperature": 0, "stop": [copied[len(copied) // 2]]}
    drafted, plain = (
        chat(drafting_server, messages, **stop),
        chat(cadence_server_bf16, messages, **stop),
    )
    assert answer(drafted) == answer(plain)
    text, _, reason = answer(drafted)
    assert reason == "stop" and text == full[: full.index(stop["stop"][0])]


def test_the_log_counts_each_requests_drafts(drafting_server: RunningServer) -> None:
    chat(drafting_server, task_messages("quote", 1), temperature=0)
    lines = [json.loads(line) for line in drafting_server.log_file.read_text().splitlines()]
    finished = [e for e in lines if e.get("event") == "request.finished"]
    assert finished and finished[-1]["accepted_tokens"] <= finished[-1]["draft_tokens"]
    assert any(e.get("draft_tokens") for e in finished)
    assert not [e for e in lines if e.get("level") == "error"]


def test_a_draft_model_changes_no_answer_and_drafts_free_text_too(
    draft_model_server: RunningServer, cadence_server_bf16: RunningServer
) -> None:
    greedy = {"temperature": 0, "logprobs": True}
    seeded = {"temperature": 0.8, "seed": 7}
    counts = []
    for messages, options in [(FREE, greedy), (task_messages("edit", 2), greedy), (FREE, seeded)]:
        before = [accepted_tokens(draft_model_server, c) for c in ("accepted", "draft")]
        drafted = chat(draft_model_server, messages, **options)
        plain = chat(cadence_server_bf16, messages, **options)
        assert answer(drafted) == answer(plain)
        if options is greedy:
            logprobs = [t.logprob for t in drafted.choices[0].logprobs.content]
            assert logprobs == [t.logprob for t in plain.choices[0].logprobs.content]
        after = [accepted_tokens(draft_model_server, c) for c in ("accepted", "draft")]
        counts.append([a - b for a, b in zip(after, before, strict=True)])
    # Greedy, the model's own argmax is every draft, its bits those of the verifying rows
    # (the bit-exact path): all are kept, whatever the text. How many it drafts is the
    # measured payoff's (a draft as costly as the model soon stops); sampled at 0.8, a
    # draft is kept with the probability the model gives it.
    (free_kept, free_drafted), (edit_kept, edit_drafted), _ = counts
    assert free_drafted > 0 and free_kept == free_drafted and edit_kept == edit_drafted
    log = draft_model_server.log_file.read_text().splitlines()
    assert not [e for e in map(json.loads, log) if e.get("level") == "error"]
