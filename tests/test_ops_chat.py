"""`cadence bench chat`: the seeded conversations, the driver against a fake streaming
server, the prefix-cache counters of /metrics, the report and the command end to end."""

import dataclasses
import itertools

import orjson
import pytest
import trio

from ops.chat import (
    ChatShape,
    ChatTrace,
    Conversation,
    PrefixCounters,
    ServerCounters,
    TurnRecord,
    build_trace,
    prefix_cache_delta,
    prefix_counters,
    report_text,
    run_chat,
    server_counters,
    servers_delta,
    summarize_chat,
)
from ops.client import ClientConfig, RequestRecord
from ops.commands import bench as main
from ops.prompts import PromptMaker, load_codec
from ops.scenarios import LengthRange
from tests.ops_fakes import PROMPT_TOKENS, FakeServer, train_tokenizer_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ChatShape(
    conversations=3,
    turns=3,
    system_len=40,
    user_len=LengthRange(8, 12),
    max_tokens=4,
    rate=50.0,
    think_s=0.01,
    context_window=256,
)
SMALL_FLAGS = ["--conversations", "3", "--turns", "3", "--system-len", "40", "--user-len",
               "8:12", "--max-tokens", "4", "--rate", "50", "--think-s", "0.01",
               "--context-window", "256"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return str(train_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.fixture(scope="module")
def maker(tokenizer_json):
    return PromptMaker(load_codec(tokenizer_json))


def fake_answer(messages_sent: int, max_tokens: int) -> str:
    """What FakeServer streams back to a chat request of `messages_sent` messages."""
    return "".join(f" m{messages_sent}w{i}" for i in range(max_tokens))


def expected_messages(trace: ChatTrace, conversation: Conversation, turn: int) -> list[dict]:
    """Turn `turn`'s messages: the system prompt, each earlier turn with the fake's answer
    to it, and the new user message."""
    messages = [{"role": "system", "content": trace.systems[conversation.system]}]
    for user in conversation.user_messages[: turn - 1]:
        messages.append({"role": "user", "content": user})
        answer = fake_answer(len(messages), trace.max_tokens)
        messages.append({"role": "assistant", "content": answer})
    return [*messages, {"role": "user", "content": conversation.user_messages[turn - 1]}]


def hand_made_trace(user_messages: list[list[str]], max_tokens: int = 3) -> ChatTrace:
    conversations = tuple(
        Conversation(
            index=i,
            start_s=0.01 * i,
            user_messages=tuple(texts),
            user_lens=tuple(len(t.split()) for t in texts),
            think_s=(0.0,) + (0.005,) * (len(texts) - 1),
        )
        for i, texts in enumerate(user_messages)
    )
    return ChatTrace(("be brief",), 2, max_tokens, conversations)


# the conversations


def test_the_trace_is_seeded_and_its_text_does_not_depend_on_timing(maker, tokenizer_json):
    trace = build_trace(maker, SMALL, seed=7)
    assert trace == build_trace(maker, SMALL, seed=7)
    assert trace != build_trace(maker, SMALL, seed=8)
    retimed = build_trace(maker, dataclasses.replace(SMALL, rate=5.0, think_s=2.0), seed=7)
    assert retimed.systems == trace.systems and len(trace.systems) == 1
    assert [c.user_messages for c in retimed.conversations] == [
        c.user_messages for c in trace.conversations
    ]
    assert [c.start_s for c in retimed.conversations] != [c.start_s for c in trace.conversations]

    codec = load_codec(tokenizer_json)
    assert len(codec.encode(trace.systems[0])) == SMALL.system_len
    starts = [c.start_s for c in trace.conversations]
    assert starts == sorted(starts) and starts[0] > 0
    users = [u for c in trace.conversations for u in c.user_messages]
    assert len(set(users)) == len(users) == 9  # conversations share only the system prompt
    for conversation in trace.conversations:
        assert [len(codec.encode(u)) for u in conversation.user_messages] == list(
            conversation.user_lens
        )
        assert all(8 <= n <= 12 for n in conversation.user_lens)
        assert conversation.think_s[0] == 0 and all(t > 0 for t in conversation.think_s[1:])
    first = trace.conversations[0]
    assert trace.prompt_len(first, 2) == 40 + sum(first.user_lens[:2]) + 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"turns": 0}, "must be >= 1"),
        ({"rate": 0.0}, "--rate must be > 0"),
        ({"think_s": -1.0}, "--think-s >= 0"),
        ({"system_len": 210}, "the last turn's 258 tokens"),
    ],
)
def test_a_shape_that_cannot_run_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **change)


# the driver


async def test_each_turn_extends_the_one_before_with_the_answer_returned(nursery, maker):
    server = FakeServer()
    await nursery.start(server.serve)
    trace = build_trace(maker, SMALL, seed=3)
    run = await run_chat(ClientConfig(server.url, "fake-model"), trace)

    assert [(r.conversation, r.turn) for r in run.records] == [
        (c, t) for c in range(3) for t in (1, 2, 3)
    ]
    assert all(r.request.ok and r.request.output_tokens == 4 for r in run.records)
    assert sorted(r.request.index for r in run.records) == list(range(9))
    by_first_user = {}
    for body in server.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0
        assert body["max_tokens"] == 4 and body["model"] == "fake-model"
        by_first_user.setdefault(body["messages"][1]["content"], []).append(body["messages"])
    for conversation in trace.conversations:
        sent = sorted(by_first_user[conversation.user_messages[0]], key=len)
        assert sent == [expected_messages(trace, conversation, t) for t in (1, 2, 3)]
        for before, after in itertools.pairwise(sent):
            assert after[: len(before)] == before
            assert after[len(before)]["content"] == fake_answer(len(before), 4)


async def test_a_failed_turn_ends_its_conversation_and_no_other(nursery):
    server = FakeServer()
    await nursery.start(server.serve)
    trace = hand_made_trace(
        [["a one", "a two", "a three"], ["b one", "b FAIL", "b three"], ["c one", "c two"]]
    )
    run = await run_chat(ClientConfig(server.url, "fake-model"), trace)

    assert [(r.conversation, r.turn, r.request.ok) for r in run.records] == [
        (0, 1, True), (0, 2, True), (0, 3, True),
        (1, 1, True), (1, 2, False),
        (2, 1, True), (2, 2, True),
    ]  # fmt: skip
    failed = run.records[4].request
    assert failed.status == 500 and failed.error.startswith("HTTP 500")
    sent = [body["messages"][-1]["content"] for body in server.bodies]
    assert sorted(sent) == sorted(["a one", "a two", "a three", "b one", "b FAIL", "c one",
                                   "c two"])  # fmt: skip


# the server's prefix-cache counters

CADENCE_METRICS = """\
# HELP cadence:prefix_cache_queries_total Prompt tokens looked up.
# TYPE cadence:prefix_cache_queries_total counter
cadence:prefix_cache_queries_total 1200.0
cadence:prefix_cache_queries_created 1.7e9
cadence:prefix_cache_hits_total 300.0
cadence:num_requests_running 2
"""
VLLM_METRICS = """\
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 800.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0 1712345678000
"""
VLLM_NO_SUFFIX = """\
vllm:prefix_cache_queries{model_name="a b"} 64
vllm:prefix_cache_hits{model_name="a b"} 16
"""
VLLM_GPU = """\
vllm:gpu_prefix_cache_queries_total{model_name="m"} 90
vllm:gpu_prefix_cache_hits_total{model_name="m"} 30
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (CADENCE_METRICS, PrefixCounters("cadence:prefix_cache_queries_total", 1200, 300)),
        (VLLM_METRICS, PrefixCounters("vllm:prefix_cache_queries_total", 1000, 600)),
        (VLLM_NO_SUFFIX, PrefixCounters("vllm:prefix_cache_queries", 64, 16)),
        (VLLM_GPU, PrefixCounters("vllm:gpu_prefix_cache_queries_total", 90, 30)),
        ("cadence:num_requests_running 2\n", None),
        ("cadence:prefix_cache_queries_total 10\n", None),  # hits missing
        ("", None),
    ],
)
def test_prefix_counters_know_cadence_s_and_vllm_s_names(text, expected):
    assert prefix_counters(text) == expected


def test_the_hit_rate_is_the_run_s_delta_and_unknown_without_counters():
    before = PrefixCounters("vllm:prefix_cache_queries_total", 1000, 900)
    after = PrefixCounters("vllm:prefix_cache_queries_total", 1400, 1000)
    assert prefix_cache_delta(before, after) == {
        "counter": "vllm:prefix_cache_queries_total",
        "queries": 400,
        "hits": 100,
        "hit_rate": 0.25,
    }
    assert prefix_cache_delta(before, before)["hit_rate"] is None  # no query: no rate
    assert prefix_cache_delta(None, after) is None
    assert prefix_cache_delta(before, None) is None


def test_tenants_draw_their_system_prompt_and_share_only_it(maker):
    shape = dataclasses.replace(SMALL, conversations=12, system_prompts=3)
    trace = build_trace(maker, shape, seed=1)
    assert len(set(trace.systems)) == 3
    assert {c.system for c in trace.conversations} == {0, 1, 2}
    users = [u for c in trace.conversations for u in c.user_messages]
    assert len(set(users)) == len(users) and not set(users) & set(trace.systems)


def counters(url: str, queries: float, hits: float, requests: float | None) -> ServerCounters:
    prefix = PrefixCounters("cadence:prefix_cache_queries_total", queries, hits)
    return ServerCounters(url, prefix, requests)


def test_replicas_counters_are_summed_with_each_one_s_share_of_the_requests():
    before = [counters("a", 100, 50, 4), counters("b", 0, 0, 0)]
    after = [counters("a", 700, 450, 34), counters("b", 400, 50, 10)]
    delta = servers_delta(before, after)
    assert (delta["queries"], delta["hits"], delta["computed"]) == (1000, 450, 550)
    assert delta["hit_rate"] == 0.45 and delta["largest_share"] == 0.75
    assert [s["requests"] for s in delta["servers"]] == [30, 10]
    assert servers_delta(before, [after[0], ServerCounters("b", None, 10)]) is None
    unknown_requests = servers_delta(before, [after[0], counters("b", 400, 50, None)])
    assert unknown_requests["largest_share"] is None and unknown_requests["hits"] == 450


def test_server_counters_read_requests_under_either_name():
    assert server_counters("u", "cadence:request_received_total 7\n").requests == 7
    vllm = (
        'vllm:request_success_total{finished_reason="stop"} 3\n'
        'vllm:request_success_total{finished_reason="length"} 2\n'
    )
    assert server_counters("u", vllm).requests == 5
    assert server_counters("u", None) == ServerCounters("u", None, None)


# the report


def turn(conversation, number, ttft_s, *, error=None, cached=None, prompt=100):
    """A turn sent at 1 s whose chunks came `ttft_s` later and then 10 ms apart."""
    chunks = [] if error else [1 + ttft_s, 1 + ttft_s + 0.01, 1 + ttft_s + 0.02]
    request = RequestRecord(
        index=conversation * 10 + number,
        role="chat",
        tenant=None,
        arrival_s=1.0,
        prompt_len=prompt,
        max_tokens=3,
        send_s=1.0,
        first_token_s=chunks[0] if chunks else None,
        end_s=chunks[-1] if chunks else 1.5,
        chunk_times=chunks,
        completion_tokens=None if error else 3,
        prompt_tokens=None if error else prompt,
        cached_tokens=cached,
        error=error,
    )
    return TurnRecord(conversation, number, request)


def test_the_report_gives_ttft_percentiles_by_turn_and_both_cache_measures():
    records = [
        turn(0, 1, 0.5, cached=0),
        turn(1, 1, 0.9, cached=0),
        turn(2, 1, 0.7, cached=10),
        turn(3, 1, 0.3, error="HTTP 500: boom"),
        turn(0, 2, 0.1, cached=80, prompt=200),
        turn(1, 2, 0.2, cached=90, prompt=200),
    ]
    prefix_cache = {"counter": "cadence:prefix_cache_queries_total", "queries": 800.0,
                    "hits": 200.0, "hit_rate": 0.25}  # fmt: skip
    summary = summarize_chat(records, prefix_cache)

    first, second = summary["by_turn"]
    assert (first["turn"], first["requests"], first["succeeded"]) == (1, 4, 3)
    assert first["ttft_ms"]["n"] == 3
    assert first["ttft_ms"]["p50"] == pytest.approx(700)
    assert first["ttft_ms"]["p99"] == pytest.approx(896)  # 700 + 0.98 * (900 - 700)
    assert second["ttft_ms"]["p50"] == pytest.approx(150)
    assert second["ttft_ms"]["p99"] == pytest.approx(199)
    assert first["cached_share"] == pytest.approx(10 / 300)
    assert second["cached_share"] == pytest.approx(170 / 400)
    assert summary["cached_share"] == pytest.approx(180 / 700)
    assert summary["ttft_ms"]["p50"] == pytest.approx(500)  # of 100, 200, 500, 700, 900
    assert summary["itl_ms"]["p50"] == pytest.approx(10)
    assert (summary["succeeded"], summary["failed"]) == (5, 1)
    assert summary["output_tokens"] == 15
    assert summary["prefix_cache"] == prefix_cache

    text = report_text(summary, "heading")
    rows = text.split("by turn (turn 1 is cold)\n")[1].splitlines()
    assert rows[2].split() == ["1", "3", "/", "4", "700.0", "896.0", "3.3%"]
    assert rows[3].split() == ["2", "2", "/", "2", "150.0", "199.0", "42.5%"]
    assert "hit rate (/metrics): 25.0%, 200 of 800 prompt tokens" in text
    assert "cached share of prompt tokens (usage): 25.7%" in text
    assert "HTTP 500: boom" in text


def test_unknown_cache_measures_read_unknown_not_zero():
    summary = summarize_chat([turn(0, 1, 0.5)], None)
    assert summary["prefix_cache"] is None and summary["cached_share"] is None
    text = report_text(summary, "heading")
    assert "hit rate (/metrics): unknown" in text
    assert "cached share of prompt tokens (usage): unknown" in text


# the command


async def run_main(argv):
    return await trio.to_thread.run_sync(main, argv)


@pytest.mark.parametrize("metrics_prefix", ["cadence:", "vllm:", None])
async def test_the_command_runs_every_turn_and_reads_the_hit_rate_from_metrics(
    metrics_prefix, nursery, tmp_path, tokenizer_json, maker, capsys
):
    # counters that start high: a lifetime ratio (0.6) is not the run's (2 of 5 tokens)
    server = FakeServer(
        cached_tokens=2,
        metrics_prefix=metrics_prefix,
        prefix_cache_queries=1000,
        prefix_cache_hits=600,
    )
    await nursery.start(server.serve)
    out = tmp_path / "run"
    plots = [] if metrics_prefix == "vllm:" else ["--no-plots"]
    argv = ["chat", "--url", server.url, "--tokenizer", tokenizer_json, "--out", str(out),
            "--seed", "5", *SMALL_FLAGS, *plots]  # fmt: skip
    assert await run_main(argv) == 0

    doc = orjson.loads((out / "chat.json").read_bytes())
    assert doc["model"] == "fake-model" and doc["scenario"] == "chat"
    assert doc["config"]["conversations"] == 3 and doc["config"]["user_len"] == "8:12"
    assert doc["workload"]["seed"] == 5 and doc["workload"]["user_len"] == {"lo": 8, "hi": 12}
    assert doc["workload"]["think_s"] == 0.01 and doc["workload"]["max_tokens"] == 4
    requests = doc["requests"]
    assert len(requests) == 9 and all(r["error"] is None for r in requests)
    assert [(r["conversation"], r["turn"]) for r in requests] == [
        (c, t) for c in range(3) for t in (1, 2, 3)
    ]
    assert all(r["cached_tokens"] == 2 and r["prompt_tokens"] == PROMPT_TOKENS for r in requests)
    summary = doc["summary"]
    assert summary["cached_share"] == pytest.approx(2 / PROMPT_TOKENS)
    assert [t["requests"] for t in summary["by_turn"]] == [3, 3, 3]
    # the fake names its request counter like cadence's whatever its prefix
    requests = 9 if metrics_prefix == "cadence:" else None
    if metrics_prefix is None:
        assert summary["prefix_cache"] is None
    else:
        assert summary["prefix_cache"] == {
            "counter": f"{metrics_prefix}prefix_cache_queries_total",
            "queries": 9 * PROMPT_TOKENS,
            "hits": 9 * 2,
            "hit_rate": pytest.approx(2 / PROMPT_TOKENS),
            "computed": 9 * (PROMPT_TOKENS - 2),
            "servers": [
                {"url": server.url, "queries": 9 * PROMPT_TOKENS, "hits": 18, "requests": requests}
            ],
            "largest_share": None if requests is None else 1.0,
        }

    # the same seed and tokenizer make the same conversations for any server
    trace = build_trace(maker, SMALL, seed=5)
    expected = [
        expected_messages(trace, conversation, t)
        for conversation in trace.conversations
        for t in (1, 2, 3)
    ]
    received = [body["messages"] for body in server.bodies]
    assert sorted(map(orjson.dumps, received)) == sorted(map(orjson.dumps, expected))

    summary_text = (out / "summary.txt").read_text()
    assert summary_text.strip() in capsys.readouterr().out
    assert ("hit rate (/metrics): unknown" in summary_text) == (metrics_prefix is None)
    if metrics_prefix == "vllm:":
        assert (out / "ttft_by_prompt_len.png").read_bytes().startswith(PNG_MAGIC)


async def test_counters_are_read_from_every_metrics_url(nursery, tmp_path, tokenizer_json):
    """Behind a router: the replicas' counters, summed, and where the requests went."""
    served, idle = (
        FakeServer(cached_tokens=2, metrics_prefix="cadence:"),
        FakeServer(metrics_prefix="cadence:"),
    )
    for server in (served, idle):
        await nursery.start(server.serve)
    out = tmp_path / "run"
    argv = ["chat", "--url", served.url, "--tokenizer", tokenizer_json, "--out", str(out),
            "--metrics-url", served.url, "--metrics-url", idle.url, "--no-plots",
            *SMALL_FLAGS]  # fmt: skip
    assert await run_main(argv) == 0
    cache = orjson.loads((out / "chat.json").read_bytes())["summary"]["prefix_cache"]
    assert [s["url"] for s in cache["servers"]] == [served.url, idle.url]
    assert [s["requests"] for s in cache["servers"]] == [9, 0] and cache["largest_share"] == 1.0
    assert (cache["queries"], cache["hits"]) == (9 * PROMPT_TOKENS, 18)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--user-len", "64:8"], "must satisfy 1 <= LO <= HI"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--system-len", "8000"], "do not fit the 8192-token context window"),
    ],
)
async def test_bad_flags_exit_2_with_a_clear_message(flags, message, tmp_path, capsys):
    assert await run_main(["chat", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cadence bench chat: ") and message in err
