"""`cadence bench SCENARIO ...`: run a workload against an OpenAI-compatible server.

Writes bench.json (config, summary, every request's timestamps), summary.txt (the printed
tables) and PNG plots into --out. `cadence bench compare ...` runs one workload against
several servers (see ops/compare.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import trio

from ops import scenarios
from ops.client import ClientConfig, RequestSpec, RunResult, discover_model, run_workload
from ops.plots import write_bench_plots
from ops.prompts import PromptMaker, load_codec
from ops.summary import (
    SLO,
    groups_table,
    interference_table,
    interference_windows,
    summarize,
    summarize_groups,
    summary_table,
)
from ops.tool_main import run_tool

DEFAULT_URL = "http://127.0.0.1:8000"

# (flag, argparse kwargs, scenarios that use it)
WORKLOAD_ARGS: list[tuple[str, dict[str, Any], set[str]]] = [
    ("--requests", {"type": int, "default": 32, "help": "number of requests"}, {"throughput"}),
    (
        "--adapters",
        {"default": "", "help": "LoRA adapters (served names, a,b,c) the requests are spread over"},
        {"throughput"},
    ),
    (
        "--prompt-len",
        {"default": "256", "help": "prompt tokens: N or LO:HI"},
        {"throughput", "poisson"},
    ),
    (
        "--output-len",
        {"default": "128", "help": "output tokens: N or LO:HI"},
        {"throughput", "poisson"},
    ),
    ("--rate", {"type": float, "default": 2.0, "help": "arrivals per second"}, {"poisson"}),
    (
        "--duration",
        {"type": float, "default": 20.0, "help": "seconds of arrivals"},
        {"poisson", "tenants"},
    ),
    (
        "--decoders",
        {"type": int, "default": 4, "help": "requests decoding throughout"},
        {"interference"},
    ),
    ("--decoder-prompt-len", {"type": int, "default": 64}, {"interference"}),
    (
        "--decoder-tokens",
        {"type": int, "default": 400, "help": "output tokens of each decoder"},
        {"interference"},
    ),
    (
        "--inject",
        {
            "default": "256@2,1024@5,4096@8",
            "help": "injected prompts LENGTH@SECONDS,... (e.g. 256@2,1024@6,4096@10)",
        },
        {"interference"},
    ),
    (
        "--injected-tokens",
        {"type": int, "default": 8, "help": "output tokens of an injected prompt"},
        {"interference"},
    ),
    ("--heavy-requests", {"type": int, "default": 16}, {"tenants"}),
    ("--heavy-prompt-len", {"default": "512"}, {"tenants"}),
    ("--heavy-output-len", {"default": "128"}, {"tenants"}),
    ("--light-rate", {"type": float, "default": 1.0}, {"tenants"}),
    ("--light-prompt-len", {"default": "64"}, {"tenants"}),
    ("--light-output-len", {"default": "32"}, {"tenants"}),
]


def add_workload_args(parser: argparse.ArgumentParser, scenario: str | None) -> None:
    """The knobs of `scenario` (all scenarios' knobs when None, as compare needs)."""
    group = parser.add_argument_group("workload")
    for flag, kwargs, used_by in WORKLOAD_ARGS:
        if scenario is None or scenario in used_by:
            group.add_argument(flag, **kwargs)


def add_client_args(
    parser: argparse.ArgumentParser, *, single_url: bool = True, slo: bool = True
) -> None:
    if single_url:
        parser.add_argument("--url", default=DEFAULT_URL, help="server base URL")
    parser.add_argument("--model", help="model name to request (default: the server's first)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CADENCE_API_KEY"),
        help="sent as Authorization: Bearer (default: $CADENCE_API_KEY)",
    )
    parser.add_argument(
        "--tokenizer",
        help="tokenizer.json, HF model dir or .gguf (default: cadence's default model)",
    )
    parser.add_argument("--seed", type=int, default=0, help="same seed, same workload")
    parser.add_argument("--out", type=Path, help="output directory (default artifacts/bench/...)")
    if slo:
        parser.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT target")
        parser.add_argument(
            "--slo-itl-p99-ms", type=float, help="goodput: per-request p99 ITL target"
        )
    parser.add_argument("--concurrency", type=int, help="at most this many requests in flight")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence bench", description=__doc__)
    subs = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name in scenarios.SCENARIOS:
        sub = subs.add_parser(name, help=getattr(scenarios, name).__doc__)
        add_workload_args(sub, name)
        add_client_args(sub)
    subs.add_parser("compare", help="one workload against several servers", add_help=False)
    subs.add_parser("capacity", help="the highest rate meeting latency targets", add_help=False)
    subs.add_parser("chat", help="multi-turn conversations sharing a system prompt", add_help=False)
    subs.add_parser("prefix", help="one long document, then questions: TTFT", add_help=False)
    subs.add_parser(
        "structured", help="free requests beside constrained ones: throughput", add_help=False
    )
    subs.add_parser("engine", help="the engine alone on the real model, no HTTP", add_help=False)
    subs.add_parser("sampler", help="the sampler alone: cost per setting", add_help=False)
    subs.add_parser(
        "processors", help="vLLM's sampling parameters: their cost in a step", add_help=False
    )
    subs.add_parser(
        "plan", help="the host's work from a decode step's plan to its forward", add_help=False
    )
    subs.add_parser(
        "speculation",
        help="one stream on repetitive and free text: drafts accepted",
        add_help=False,
    )
    return parser


def build_specs(scenario: str, args: argparse.Namespace, maker: PromptMaker) -> list[RequestSpec]:
    """The workload of `scenario`; raises ValueError for bad knobs."""
    rng = random.Random(args.seed)
    lengths = scenarios.parse_length_range
    if scenario == "throughput":
        specs = scenarios.throughput(
            maker,
            rng,
            requests=args.requests,
            prompt=lengths(args.prompt_len),
            output=lengths(args.output_len),
        )
        return scenarios.spread_over_adapters(specs, args.adapters)
    if scenario == "poisson":
        return scenarios.poisson(
            maker,
            rng,
            rate=args.rate,
            duration_s=args.duration,
            prompt=lengths(args.prompt_len),
            output=lengths(args.output_len),
        )
    if scenario == "interference":
        return scenarios.interference(
            maker,
            rng,
            decoders=args.decoders,
            decoder_prompt_len=args.decoder_prompt_len,
            decoder_tokens=args.decoder_tokens,
            injections=scenarios.parse_injections(args.inject),
            injected_tokens=args.injected_tokens,
        )
    if scenario == "tenants":
        return scenarios.tenants(
            maker,
            rng,
            heavy_requests=args.heavy_requests,
            heavy_prompt=lengths(args.heavy_prompt_len),
            heavy_output=lengths(args.heavy_output_len),
            light_rate=args.light_rate,
            duration_s=args.duration,
            light_prompt=lengths(args.light_prompt_len),
            light_output=lengths(args.light_output_len),
        )
    raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(scenarios.SCENARIOS)}")


@dataclass(slots=True)
class BenchRun:
    label: str
    url: str
    model: str
    result: RunResult
    summary: dict[str, Any]
    groups: dict[str, dict[str, Any]]
    windows: list[dict[str, Any]]


def slo_from_args(args: argparse.Namespace) -> SLO:
    return SLO(ttft_ms=args.slo_ttft_ms, itl_p99_ms=args.slo_itl_p99_ms)


def client_config(url: str, model: str, args: argparse.Namespace) -> ClientConfig:
    return ClientConfig(
        base_url=url,
        model=model,
        api_key=args.api_key,
        timeout_s=args.timeout,
        concurrency=args.concurrency,
    )


async def execute(
    url: str, label: str, specs: list[RequestSpec], args: argparse.Namespace
) -> BenchRun:
    model = args.model or await discover_model(url, args.api_key)
    result = await run_workload(client_config(url, model, args), specs)
    slo = slo_from_args(args)
    return BenchRun(
        label=label,
        url=url,
        model=model,
        result=result,
        summary=summarize(result.records, slo),
        groups=summarize_groups(result.records, slo),
        windows=interference_windows(result.records),
    )


def report_text(run: BenchRun, scenario: str) -> str:
    parts = [
        f"cadence bench {scenario} against {run.url} (model {run.model})",
        summary_table(run.summary),
    ]
    if len(run.groups) > 1:
        parts.append("by group (ms)\n" + groups_table(run.groups))
    if run.windows:
        parts.append("decoders while each prompt was injected\n" + interference_table(run.windows))
        parts += [
            f"note: no decoder was streaming while the {w['prompt_len']}-token prompt was "
            "computed; give the decoders more --decoder-tokens"
            for w in run.windows
            if w["decoders_active"] == 0
        ]
    if run.summary["errors"]:
        parts.append("errors:\n" + "\n".join(f"  {e}" for e in run.summary["errors"]))
    return "\n\n".join(parts)


# credentials a run's report must not record
SECRET_ARGS = frozenset({"api_key", "admin_token"})


def jsonable_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as a report records them: paths as text, credentials left out."""
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in SECRET_ARGS
    }


def write_run(run: BenchRun, scenario: str, args: argparse.Namespace, out_dir: Path) -> str:
    """bench.json, summary.txt and (unless --no-plots) the PNGs; returns the report text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "scenario": scenario,
        "label": run.label,
        "url": run.url,
        "model": run.model,
        "started_unix": run.result.started_unix,
        "config": jsonable_args(args),
        "summary": run.summary,
        "groups": run.groups,
        "interference": run.windows,
        "requests": [dataclasses.asdict(r) for r in run.result.records],
    }
    (out_dir / "bench.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    text = report_text(run, scenario)
    (out_dir / "summary.txt").write_text(text + "\n")
    if not args.no_plots:
        write_bench_plots(run.result.records, out_dir, run.label)
    return text


def default_out_dir(name: str) -> Path:
    return Path("artifacts") / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_specs(scenario: str, args: argparse.Namespace) -> list[RequestSpec]:
    maker = PromptMaker(load_codec(args.tokenizer))
    return build_specs(scenario, args, maker)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_tool("cadence bench", build_parser(), argv, measured_scenario, write_scenario)


def measured_scenario(args: argparse.Namespace) -> BenchRun:
    specs = prepare_specs(args.scenario, args)
    return trio.run(execute, args.url, args.url, specs, args)


def write_scenario(args: argparse.Namespace, run: BenchRun) -> int:
    out_dir = args.out or default_out_dir(args.scenario)
    print(write_run(run, args.scenario, args, out_dir))
    print(f"\nwrote {out_dir}/bench.json")
    return 0 if run.summary["succeeded"] else 1
