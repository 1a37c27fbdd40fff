"""`cadence bench prefix`: one long document, then short questions about it, one at a time.

    cadence bench prefix --url URL [--prefix-len 1900] [--questions 4] [--question-len 8]
        [--max-tokens 8] [--seed 0]

The first request computes the document; with a prefix cache every later one finds it
cached, so its TTFT is that of its question alone. The last request repeats the first.
Prints each request's TTFT, prompt tokens and cached tokens (from the usage, when the
server sends them) and its TTFT as a fraction of the first's; writes prefix.json.
Requests go one after another, so each TTFT is the server's alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import orjson
import trio

from ops.bench import add_client_args, client_config, default_out_dir, jsonable_args
from ops.client import (
    RequestRecord,
    RequestSpec,
    discover_model,
    new_record,
    open_client,
    request_body,
    send_timed,
)
from ops.prompts import PromptMaker, load_codec
from ops.summary import format_table
from ops.tool_main import run_tool

PROG = "cadence bench prefix"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix-len", type=int, default=1900, help="document tokens")
    parser.add_argument("--questions", type=int, default=4, help="different questions")
    parser.add_argument("--question-len", type=int, default=8, help="tokens of each question")
    parser.add_argument("--max-tokens", type=int, default=8, help="answer tokens")
    add_client_args(parser, slo=False)
    return parser


def build_prompts(maker: PromptMaker, args: argparse.Namespace) -> list[RequestSpec]:
    """The document with each question appended, then the first again."""
    if min(args.prefix_len, args.questions, args.question_len, args.max_tokens) < 1:
        raise ValueError("--prefix-len, --questions, --question-len and --max-tokens must be >= 1")
    offsets = maker.distinct_offsets(random.Random(args.seed), args.questions + 1)
    document = maker.make(args.prefix_len, offsets[0])
    questions = [maker.make(args.question_len, offset) for offset in offsets[1:]]
    prompts = [f"{document}\n{q}" for q in [*questions, questions[0]]]
    length = args.prefix_len + args.question_len  # about: the newline may merge
    return [RequestSpec(i, 0.0, p, length, args.max_tokens) for i, p in enumerate(prompts)]


async def measure(args: argparse.Namespace, specs: list[RequestSpec]) -> list[RequestRecord]:
    model = args.model or await discover_model(args.url, args.api_key)
    config = client_config(args.url, model, args)
    records = []
    async with open_client(config) as client:
        t0 = trio.current_time()
        for spec in specs:  # one at a time
            record = new_record(spec)
            body = request_body(config, spec)
            await send_timed(client, config, "/v1/completions", body, {}, record, t0)
            records.append(record)
    return records


def report(records: list[RequestRecord]) -> str:
    first = records[0].first_token_s, records[0].send_s
    first_ttft = None if None in first else first[0] - first[1]
    rows = []
    for record in records:
        ttft = None
        if record.first_token_s is not None and record.send_s is not None:
            ttft = record.first_token_s - record.send_s
        ratio = f"{ttft / first_ttft:.3f}" if ttft is not None and first_ttft else "-"
        rows.append(
            [
                "first again" if record is records[-1] else str(record.index + 1),
                None if ttft is None else ttft * 1000,
                record.prompt_tokens,
                "unknown" if record.cached_tokens is None else str(record.cached_tokens),
                ratio,
                record.error or "",
            ]
        )
    header = ["request", "TTFT ms", "prompt tokens", "cached tokens", "TTFT / first's", "error"]
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    return run_tool(PROG, build_parser(), argv, measured_prompts, write_prefix_report)


def measured_prompts(args: argparse.Namespace) -> list[RequestRecord]:
    specs = build_prompts(PromptMaker(load_codec(args.tokenizer)), args)
    return trio.run(measure, args, specs)


def write_prefix_report(args: argparse.Namespace, records: list[RequestRecord]) -> int:
    out_dir: Path = args.out or default_out_dir("prefix")
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "args": jsonable_args(args),
        "records": [dataclasses.asdict(r) for r in records],
    }
    (out_dir / "prefix.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    print(f"{PROG} against {args.url}\n\n{report(records)}\n\nwrote {out_dir}/prefix.json")
    return 0 if all(r.ok for r in records) else 1
