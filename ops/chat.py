"""`cadence bench chat`: multi-turn conversations that share one system prompt.

    cadence bench chat --url URL [--conversations 16] [--turns 4] [--system-len 1024]
        [--user-len 64] [--max-tokens 64] [--rate 1] [--think-s 1] [--seed 0]

Conversations start at Poisson arrivals (--rate a second) and run concurrently. Each turn
sends the system prompt, every earlier turn (the answers as the server gave them) and a new
user message to /v1/chat/completions, so turn k's prompt extends turn k-1's and every
conversation's begins with the same system prompt: what prefix caching reuses. A turn is
sent an exponential think time (mean --think-s) after the answer to the one before. With
the same --seed and --tokenizer, the same text and timing against any server, vLLM included.

Reports TTFT by turn (turn 1 is cold), TTFT and ITL overall, output tokens/s, the prefix-cache
hit rate from the server's /metrics counters (cadence:prefix_cache_* or vllm:prefix_cache_*,
read before and after the run) and the cached share of prompt tokens from the responses'
usage.prompt_tokens_details.cached_tokens. Writes chat.json, summary.txt and PNG plots
into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

from ops import scenarios
from ops.bench import add_client_args, client_config, default_out_dir, jsonable_args
from ops.client import (
    ClientConfig,
    RequestRecord,
    api_root,
    auth_headers,
    discover_model,
    open_client,
    send_chat,
)
from ops.plots import write_bench_plots
from ops.prompts import PromptMaker, load_codec
from ops.summary import SLO, distribution, format_table, summarize, to_ms, ttft
from ops.tool_main import run_tool

PROG = "cadence bench chat"
METRICS_TIMEOUT_S = 10.0
# (queries, hits) counter names, in tokens, the first pair a server exports wins; vLLM
# 0.8-0.10 named them gpu_prefix_cache_*, and prometheus_client adds `_total` to counters.
PREFIX_CACHE_COUNTERS = (
    ("cadence:prefix_cache_queries", "cadence:prefix_cache_hits"),
    ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"),
    ("vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_argument_group("conversations")
    group.add_argument("--conversations", type=int, default=16, help="conversations in the run")
    group.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    group.add_argument("--system-len", type=int, default=1024, help="shared system prompt tokens")
    group.add_argument(
        "--system-prompts",
        type=int,
        default=1,
        help="distinct system prompts (tenants); each conversation draws one",
    )
    group.add_argument("--user-len", default="64", help="tokens of each user message: N or LO:HI")
    group.add_argument("--max-tokens", type=int, default=64, help="answer tokens of every turn")
    group.add_argument("--rate", type=float, default=1.0, help="conversation starts per second")
    group.add_argument("--think-s", type=float, default=1.0, help="mean pause before a turn")
    group.add_argument(
        "--context-window",
        type=int,
        default=scenarios.CONTEXT_WINDOW,
        help="the last turn's prompt + answer must fit in it",
    )
    add_client_args(parser, slo=False)
    parser.add_argument(
        "--metrics-url",
        action="append",
        help="read the prefix-cache and request counters here (repeat for the replicas behind "
        "a router: summed, with each one's share of the requests; default: --url)",
    )
    return parser


@dataclass(frozen=True, slots=True)
class ChatShape:
    """What the conversations look like, checked before any request is sent."""

    conversations: int
    turns: int
    system_len: int
    user_len: scenarios.LengthRange
    max_tokens: int
    rate: float
    think_s: float
    context_window: int = scenarios.CONTEXT_WINDOW
    system_prompts: int = 1

    def __post_init__(self) -> None:
        if min(self.conversations, self.turns, self.system_len, self.max_tokens) < 1:
            raise ValueError("--conversations, --turns, --system-len and --max-tokens must be >= 1")
        if self.system_prompts < 1:
            raise ValueError("--system-prompts must be >= 1")
        if self.rate <= 0 or self.think_s < 0:
            raise ValueError("--rate must be > 0 and --think-s >= 0")
        # the chat template adds a few tokens a message on top of this
        longest = self.system_len + self.turns * (self.user_len.hi + self.max_tokens)
        if longest > self.context_window:
            raise ValueError(
                f"the last turn's {longest} tokens (system, user messages and answers) do not "
                f"fit the {self.context_window}-token context window"
            )


def shape_from_args(args: argparse.Namespace) -> ChatShape:
    return ChatShape(
        conversations=args.conversations,
        turns=args.turns,
        system_len=args.system_len,
        user_len=scenarios.parse_length_range(args.user_len),
        max_tokens=args.max_tokens,
        rate=args.rate,
        think_s=args.think_s,
        context_window=args.context_window,
        system_prompts=args.system_prompts,
    )


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    start_s: float  # first turn's send time, seconds after the run starts
    user_messages: tuple[str, ...]
    user_lens: tuple[int, ...]  # tokens of each user message
    think_s: tuple[float, ...]  # pause before each turn after an answer (0 before the first)
    system: int = 0  # which of the trace's system prompts it starts with


@dataclass(frozen=True, slots=True)
class ChatTrace:
    systems: tuple[str, ...]  # each --system-len tokens; conversations share them
    system_len: int
    max_tokens: int
    conversations: tuple[Conversation, ...]

    def prompt_len(self, conversation: Conversation, turn: int) -> int:
        """Tokens of turn `turn`'s messages as this client counts them (answers at
        max_tokens); the server's count, with its chat template, is the usage's."""
        users = sum(conversation.user_lens[:turn])
        return self.system_len + users + (turn - 1) * self.max_tokens


def think_time(rng: random.Random, mean_s: float) -> float:
    return rng.expovariate(1 / mean_s) if mean_s > 0 else 0.0


def build_trace(maker: PromptMaker, shape: ChatShape, seed: int) -> ChatTrace:
    """The conversations of `shape`, a pure function of the seed and the tokenizer.

    Text and timing draw from their own generators, so changing --rate or --think-s moves
    the requests in time and never changes what they say.
    """
    rng = random.Random(seed)
    text_rng, time_rng = random.Random(rng.getrandbits(64)), random.Random(rng.getrandbits(64))
    count = shape.conversations * shape.turns
    # distinct corpus offsets: conversations share a system prompt and nothing else
    k = shape.system_prompts
    all_offsets = maker.distinct_offsets(text_rng, k + count)
    system_offsets, offsets = all_offsets[:k], all_offsets[k:]
    conversations, start = [], 0.0
    for index in range(shape.conversations):
        lens = tuple(shape.user_len.draw(text_rng) for _ in range(shape.turns))
        own = offsets[index * shape.turns : (index + 1) * shape.turns]
        start += time_rng.expovariate(shape.rate)
        pauses = [think_time(time_rng, shape.think_s) for _ in range(shape.turns - 1)]
        conversations.append(
            Conversation(
                index=index,
                start_s=start,
                user_messages=tuple(maker.make(n, at) for n, at in zip(lens, own, strict=True)),
                user_lens=lens,
                think_s=(0.0, *pauses),
                # (one system prompt draws nothing: the trace is what it was before tenants)
                system=text_rng.randrange(k) if k > 1 else 0,
            )
        )
    return ChatTrace(
        systems=tuple(maker.make(shape.system_len, at) for at in system_offsets),
        system_len=shape.system_len,
        max_tokens=shape.max_tokens,
        conversations=tuple(conversations),
    )


@dataclass(slots=True)
class TurnRecord:
    conversation: int
    turn: int  # 1-based: turn 1 is the cold one
    request: RequestRecord


def turn_record(trace: ChatTrace, conversation: Conversation, turn: int, at: float) -> TurnRecord:
    request = RequestRecord(
        index=conversation.index * len(conversation.user_messages) + turn - 1,
        role="chat",
        tenant=None,
        arrival_s=at,
        prompt_len=trace.prompt_len(conversation, turn),
        max_tokens=trace.max_tokens,
    )
    return TurnRecord(conversation.index, turn, request)


async def run_conversation(
    client: httpx.AsyncClient,
    config: ClientConfig,
    trace: ChatTrace,
    conversation: Conversation,
    records: list[TurnRecord],
    t0: float,
    limiter: trio.CapacityLimiter | None,
) -> None:
    """Its turns one after another into `records`; a failed turn ends the conversation."""
    await trio.sleep_until(t0 + conversation.start_s)
    messages = [{"role": "system", "content": trace.systems[conversation.system]}]
    for turn, (user, pause) in enumerate(
        zip(conversation.user_messages, conversation.think_s, strict=True), start=1
    ):
        await trio.sleep(pause)
        messages.append({"role": "user", "content": user})
        record = turn_record(trace, conversation, turn, trio.current_time() - t0)
        records.append(record)
        async with limiter if limiter is not None else contextlib.nullcontext():
            answer = await send_chat(
                client, config, list(messages), trace.max_tokens, record.request, t0
            )
        if not record.request.ok:
            return  # the next turn would need this one's answer
        messages.append({"role": "assistant", "content": answer})


@dataclass(slots=True)
class ChatRun:
    records: list[TurnRecord]  # by conversation, then turn
    started_unix: float


async def run_chat(config: ClientConfig, trace: ChatTrace) -> ChatRun:
    """Every conversation as its own task, started at its arrival."""
    per_conversation: list[list[TurnRecord]] = [[] for _ in trace.conversations]
    limiter = trio.CapacityLimiter(config.concurrency) if config.concurrency else None
    async with open_client(config) as client:
        started_unix = time.time()
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for conversation, records in zip(trace.conversations, per_conversation, strict=True):
                nursery.start_soon(
                    run_conversation, client, config, trace, conversation, records, t0, limiter
                )
    return ChatRun([r for records in per_conversation for r in records], started_unix)


# the server's prefix-cache counters


@dataclass(frozen=True, slots=True)
class PrefixCounters:
    name: str  # the queries counter found, e.g. "vllm:prefix_cache_queries_total"
    queries: float  # prompt tokens looked up in the cache
    hits: float  # of them, tokens found there


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text as {metric name: value summed over its label sets}."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        series, _, rest = line.rpartition("}")  # label values may hold spaces
        if series:
            name, fields = series.partition("{")[0], rest.split()
        else:
            name, *fields = line.split()
        try:
            value = float(fields[0])  # a timestamp may follow
        except (IndexError, ValueError):
            continue  # a line this parser does not understand is not one it needs
        samples[name] = samples.get(name, 0.0) + value
    return samples


def prefix_counters(text: str) -> PrefixCounters | None:
    """The prefix-cache counters in a /metrics text, or None when it has neither scheme's."""
    samples = metric_samples(text)
    for queries, hits in PREFIX_CACHE_COUNTERS:
        for suffix in ("_total", ""):
            if queries + suffix in samples and hits + suffix in samples:
                return PrefixCounters(
                    queries + suffix, samples[queries + suffix], samples[hits + suffix]
                )
    return None


# requests a server took: cadence counts them as they arrive, vLLM as they finish
REQUEST_COUNTERS = ("cadence:request_received_total", "vllm:request_success_total")


@dataclass(frozen=True, slots=True)
class ServerCounters:
    url: str
    prefix: PrefixCounters | None  # None: /metrics unreadable or without them
    requests: float | None


def server_counters(url: str, text: str | None) -> ServerCounters:
    if text is None:
        return ServerCounters(url, None, None)
    samples = metric_samples(text)
    requests = next((samples[name] for name in REQUEST_COUNTERS if name in samples), None)
    return ServerCounters(url, prefix_counters(text), requests)


async def scrape_counters(url: str, api_key: str | None = None) -> ServerCounters:
    """The server's counters now (unknown where the key may not read /metrics)."""
    try:
        async with httpx.AsyncClient(timeout=METRICS_TIMEOUT_S) as client:
            response = await client.get(f"{api_root(url)}/metrics", headers=auth_headers(api_key))
    except httpx.HTTPError:
        return server_counters(url, None)
    return server_counters(url, response.text if response.status_code == 200 else None)


def _difference(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def servers_delta(
    before: Sequence[ServerCounters], after: Sequence[ServerCounters]
) -> dict[str, Any] | None:
    """What the run added to the servers' counters, summed over them (None: unknown, a
    server did not say), with each server's own part: behind a router, where its requests
    went and how much of their prompts each cache held."""
    parts = [prefix_cache_delta(b.prefix, a.prefix) for b, a in zip(before, after, strict=True)]
    if not parts or any(part is None for part in parts):
        return None
    queries = sum(part["queries"] for part in parts)
    hits = sum(part["hits"] for part in parts)
    servers = [
        {
            "url": a.url,
            "queries": part["queries"],
            "hits": part["hits"],
            "requests": _difference(b.requests, a.requests),
        }
        for b, a, part in zip(before, after, parts, strict=True)
    ]
    counted = [server["requests"] for server in servers]
    total = sum(counted) if None not in counted else None
    return {
        "counter": parts[0]["counter"],
        "queries": queries,
        "hits": hits,
        "hit_rate": hits / queries if queries > 0 else None,
        "computed": queries - hits,  # prompt tokens the servers had to compute
        "servers": servers,
        "largest_share": max(counted) / total if total else None,
    }


def prefix_cache_delta(
    before: PrefixCounters | None, after: PrefixCounters | None
) -> dict[str, Any] | None:
    """What the run added to the counters (None: unknown, the server did not say)."""
    if before is None or after is None or before.name != after.name:
        return None
    queries, hits = after.queries - before.queries, after.hits - before.hits
    return {
        "counter": after.name,
        "queries": queries,
        "hits": hits,
        "hit_rate": hits / queries if queries > 0 else None,
    }


# the report


def cached_share(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens, summed over the requests whose usage gave
    both (None when none did: the server does not report cached tokens)."""
    known = [r for r in records if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    if not known:
        return None
    return sum(r.cached_tokens for r in known) / sum(r.prompt_tokens for r in known)


def ttfts_ms(records: Sequence[RequestRecord]) -> list[float]:
    return to_ms(t for r in records if r.ok and (t := ttft(r)) is not None)


def by_turn(records: Sequence[TurnRecord]) -> list[dict[str, Any]]:
    turns: dict[int, list[RequestRecord]] = {}
    for record in records:
        turns.setdefault(record.turn, []).append(record.request)
    return [
        {
            "turn": turn,
            "requests": len(group),
            "succeeded": sum(r.ok for r in group),
            "ttft_ms": distribution(ttfts_ms(group)),
            "cached_share": cached_share(group),
        }
        for turn, group in sorted(turns.items())
    ]


def summarize_chat(
    records: Sequence[TurnRecord], prefix_cache: dict[str, Any] | None
) -> dict[str, Any]:
    """The run's numbers; `prefix_cache` is prefix_cache_delta's (None: unknown)."""
    requests = [r.request for r in records]
    return {
        **summarize(requests, SLO()),
        "by_turn": by_turn(records),
        "cached_share": cached_share(requests),
        "prefix_cache": prefix_cache,
    }


def _percent(share: float | None) -> str:
    return "unknown" if share is None else f"{share:.1%}"


def prefix_cache_line(prefix_cache: dict[str, Any] | None) -> str:
    if prefix_cache is None:
        return "prefix-cache hit rate (/metrics): unknown, no prefix-cache counters there"
    servers = prefix_cache.get("servers") or []
    where = "the server's" if len(servers) <= 1 else f"the {len(servers)} servers'"
    line = (
        f"prefix-cache hit rate (/metrics): {_percent(prefix_cache['hit_rate'])}, "
        f"{prefix_cache['hits']:,.0f} of {prefix_cache['queries']:,.0f} prompt tokens, "
        f"{prefix_cache['queries'] - prefix_cache['hits']:,.0f} computed "
        f"({prefix_cache['counter']}: all {where} traffic meanwhile)"
    )
    if len(servers) > 1:
        shares = ", ".join(
            f"{s['url']}: {s['requests']:,.0f}" for s in servers if s["requests"] is not None
        )
        line += (
            f"\nrequests by server: {shares}; largest share "
            f"{_percent(prefix_cache['largest_share'])}"
        )
    return line


def report_text(summary: dict[str, Any], heading: str) -> str:
    head = [
        ("requests (ok / failed)", f"{summary['succeeded']} / {summary['failed']}"),
        ("duration s", summary["duration_s"]),
        ("output tokens", summary["output_tokens"]),
        ("output tokens/s", summary["output_tokens_per_s"]),
    ]
    latency = [
        [label, summary[key]["p50"], summary[key]["p99"], summary[key]["n"]]
        for label, key in (("TTFT ms", "ttft_ms"), ("ITL ms", "itl_ms"))
    ]
    turns = [
        [
            t["turn"],
            f"{t['succeeded']} / {t['requests']}",
            t["ttft_ms"]["p50"],
            t["ttft_ms"]["p99"],
            _percent(t["cached_share"]),
        ]
        for t in summary["by_turn"]
    ]
    parts = [
        heading,
        format_table(["measure", "value"], head),
        format_table(["latency", "p50", "p99", "n"], latency),
        "by turn (turn 1 is cold)\n"
        + format_table(["turn", "ok", "TTFT p50 ms", "TTFT p99 ms", "cached share"], turns),
        prefix_cache_line(summary["prefix_cache"])
        + f"\ncached share of prompt tokens (usage): {_percent(summary['cached_share'])}",
    ]
    if summary["errors"]:
        parts.append("errors:\n" + "\n".join(f"  {e}" for e in summary["errors"]))
    return "\n\n".join(parts)


# the command


async def measure(
    args: argparse.Namespace, shape: ChatShape, trace: ChatTrace
) -> tuple[dict[str, Any], ChatRun]:
    """Runs the conversations; returns chat.json's document and the run."""
    model = args.model or await discover_model(args.url, args.api_key)
    metrics_urls = args.metrics_url or [args.url]
    before = [await scrape_counters(url, args.api_key) for url in metrics_urls]
    run = await run_chat(client_config(args.url, model, args), trace)
    after = [await scrape_counters(url, args.api_key) for url in metrics_urls]
    document = {
        "scenario": "chat",
        "url": args.url,
        "model": model,
        "started_unix": run.started_unix,
        "config": jsonable_args(args),
        "workload": {**dataclasses.asdict(shape), "seed": args.seed, "tokenizer": args.tokenizer},
        "summary": summarize_chat(run.records, servers_delta(before, after)),
        "requests": [
            {"conversation": r.conversation, "turn": r.turn, **dataclasses.asdict(r.request)}
            for r in run.records
        ],
    }
    return document, run


def heading(document: dict[str, Any]) -> str:
    workload = document["workload"]
    return (
        f"{PROG} against {document['url']} (model {document['model']}): "
        f"{workload['conversations']} conversations x {workload['turns']} turns, "
        f"{workload['system_prompts']} shared system prompt(s) of {workload['system_len']} tokens"
    )


def write_outputs(document: dict[str, Any], run: ChatRun, out_dir: Path, plots: bool) -> str:
    """chat.json, summary.txt and (with `plots`) the PNGs; returns the report text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "chat.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    text = report_text(document["summary"], heading(document))
    (out_dir / "summary.txt").write_text(text + "\n")
    if plots:
        write_bench_plots([r.request for r in run.records], out_dir, document["url"])
    return text


def main(argv: list[str] | None = None) -> int:
    return run_tool(PROG, build_parser(), argv, measured_chat, write_chat)


def measured_chat(args: argparse.Namespace) -> tuple[dict[str, Any], ChatRun]:
    shape = shape_from_args(args)
    trace = build_trace(PromptMaker(load_codec(args.tokenizer)), shape, args.seed)
    return trio.run(measure, args, shape, trace)


def write_chat(args: argparse.Namespace, measured: tuple[dict[str, Any], ChatRun]) -> int:
    document, run = measured
    out_dir: Path = args.out or default_out_dir("chat")
    print(write_outputs(document, run, out_dir, plots=not args.no_plots))
    print(f"\nwrote {out_dir}/chat.json")
    return 0 if document["summary"]["succeeded"] else 1
