"""`cadence bench structured`: do constrained requests slow the free ones beside them?

    cadence bench structured --url URL [--requests 16] [--beside 16] [--prompt-len 256]
        [--max-tokens 128] [--schema FILE] [--seed 0]

Three rounds of free requests (unconstrained, `ignore_eos`, all sent at once; each round's
prompts are its own, of the same lengths, so none finds another's in a prefix cache):
  alone          the free requests by themselves;
  constrained    beside `--beside` requests with a `response_format` json_schema;
  unconstrained  beside as many unconstrained requests, each as long as its constrained
                 counterpart's answer was.
The last two put the same tokens through the server, so the free requests' throughput in
the two differs only by what the grammars cost (bitmasks filled per step, masked
sampling). One constrained request goes first, outside the rounds: a server's first
grammar costs it seconds (xgrammar's import), once. Prints, per round, the free
requests' output tok/s and ITL and the requests beside them; writes structured.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import orjson
import trio

from ops.bench import add_client_args, client_config, default_out_dir, jsonable_args
from ops.client import RequestRecord, RequestSpec, discover_model, run_workload
from ops.prompts import PromptMaker, load_codec
from ops.summary import format_table
from ops.tool_main import run_tool

PROG = "cadence bench structured"
ROUND_GAP_S = 2.0  # idle between rounds: the server's logs show where each begins
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "tags"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=16, help="free requests")
    parser.add_argument("--beside", type=int, default=16, help="requests beside them")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens of each prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="of each request")
    parser.add_argument("--schema", type=Path, help="JSON schema file (default: a person)")
    add_client_args(parser, slo=False)
    return parser


def free_specs(maker: PromptMaker, args: argparse.Namespace, round_: int) -> list[RequestSpec]:
    """Each round's prompts are its own, so no round finds another's in a prefix cache."""
    if min(args.requests, args.beside, args.prompt_len, args.max_tokens) < 1:
        raise ValueError("--requests, --beside, --prompt-len and --max-tokens must be >= 1")
    return [
        RequestSpec(
            i,
            0.0,
            maker.make(args.prompt_len, 977 * i + 7919 * round_),
            args.prompt_len,
            args.max_tokens,
            role="free",
        )
        for i in range(args.requests)
    ]


def beside_specs(
    maker: PromptMaker,
    args: argparse.Namespace,
    schema: dict[str, Any] | None,
    lengths: list[int] | None,
    round_: int,
) -> list[RequestSpec]:
    """With `schema`: constrained requests; else unconstrained ones of the given lengths."""
    instruction = "Describe a person as JSON with a name, an age, a city and a few tags. "
    specs = []
    for i in range(args.beside):
        prompt = instruction + maker.make(args.prompt_len, 31 * i + 5 + 7919 * round_)
        spec = RequestSpec(
            args.requests + i, 0.0, prompt, args.prompt_len, args.max_tokens, role="beside"
        )
        if schema is not None:
            spec.response_format = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema},
            }
        else:
            assert lengths is not None
            spec.max_tokens = max(1, lengths[i])
        specs.append(spec)
    return specs


@dataclasses.dataclass(slots=True)
class Round:
    name: str
    records: list[RequestRecord]

    def of(self, role: str) -> list[RequestRecord]:
        return [r for r in self.records if r.role == role]


async def measure(args: argparse.Namespace, maker: PromptMaker, schema: dict) -> list[Round]:
    model = args.model or await discover_model(args.url, args.api_key)
    config = client_config(args.url, model, args)
    # the server's first grammar costs it seconds (xgrammar's import, the vocabulary's
    # conversion): paid here, outside the rounds
    await run_workload(config, beside_specs(maker, args, schema, None, 3)[:1])
    alone = await run_workload(config, free_specs(maker, args, 0))
    await trio.sleep(ROUND_GAP_S)
    specs = free_specs(maker, args, 1) + beside_specs(maker, args, schema, None, 1)
    constrained = await run_workload(config, specs)
    await trio.sleep(ROUND_GAP_S)
    lengths = [r.output_tokens for r in constrained.records if r.role == "beside"]
    specs = free_specs(maker, args, 2) + beside_specs(maker, args, None, lengths, 2)
    unconstrained = await run_workload(config, specs)
    return [
        Round("alone", alone.records),
        Round("constrained beside", constrained.records),
        Round("unconstrained beside", unconstrained.records),
    ]


def throughput(records: list[RequestRecord]) -> float | None:
    """Output tokens per second, from the first send to the last end."""
    done = [r for r in records if r.ok and r.send_s is not None and r.end_s is not None]
    if not done:
        return None
    span = max(r.end_s for r in done) - min(r.send_s for r in done)  # type: ignore[type-var]
    return sum(r.output_tokens for r in done) / span if span > 0 else None


def itls_ms(records: list[RequestRecord]) -> list[float]:
    gaps = []
    for r in records:
        gaps += [(b - a) * 1000 for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    return gaps


def report(rounds: list[Round]) -> str:
    rows = []
    for round_ in rounds:
        free, beside = round_.of("free"), round_.of("beside")
        gaps = itls_ms(free)
        rows.append(
            [
                round_.name,
                throughput(free),
                statistics.median(gaps) if gaps else None,
                statistics.quantiles(gaps, n=100)[98] if len(gaps) > 1 else None,
                sum(r.output_tokens for r in beside) if beside else 0,
                throughput(round_.records),
                sum(1 for r in round_.records if not r.ok),
            ]
        )
    header = [
        "round",
        "free tok/s",
        "free ITL p50 ms",
        "free ITL p99 ms",
        "beside tokens",
        "all tok/s",
        "errors",
    ]
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    bad_input = (ValueError, orjson.JSONDecodeError)
    return run_tool(PROG, build_parser(), argv, measured_rounds, write_rounds, bad_input)


def measured_rounds(args: argparse.Namespace) -> list[Round]:
    schema = orjson.loads(args.schema.read_bytes()) if args.schema else SCHEMA
    maker = PromptMaker(load_codec(args.tokenizer))
    free_specs(maker, args, 0)  # bad knobs fail here, before any request
    return trio.run(measure, args, maker, schema)


def write_rounds(args: argparse.Namespace, rounds: list[Round]) -> int:
    out_dir: Path = args.out or default_out_dir("structured")
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "args": jsonable_args(args),
        "rounds": {r.name: [dataclasses.asdict(x) for x in r.records] for r in rounds},
    }
    path = out_dir / "structured.json"
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    print(f"{PROG} against {args.url}\n\n{report(rounds)}\n\nwrote {path}")
    return 0 if all(r.ok for round_ in rounds for r in round_.records) else 1
