"""`cadence bench capacity`: the highest request rate at which most requests meet their SLO.

    cadence bench capacity --url URL [--rates 0.25,0.5,1,2] [--duration 60] [--ttft-ms 3000]
        [--itl-p99-ms 250,500,1000] [--attainment 0.9] [--bisect 2] [--label NAME]
        [--policy NAME --policy NAME --admin-token T]
    cadence bench capacity --merge DIR DIR ... --out DIR [--rescore --ttft-ms 5000 ...]

Runs the mixed workload (chat turns with long-tailed lengths, a share of long documents,
Poisson arrivals; the same seed gives the same requests at a rate against any server) at
each rate, waiting for every request to end, then bisects between the highest passing and
the lowest failing rate of the --bisect-target ITL target. With --policy, the whole sweep
runs once per policy (a cadence server's admin API). Writes capacity.json, summary.txt and
attainment.png into --out; --merge puts finished sweeps (say cadence's and vLLM's) into one
table and plot, and with --rescore judges their recorded requests against this command's
--ttft-ms, --itl-p99-ms and --attainment instead (a different SLO, no new run).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import trio

from ops import scenarios
from ops.bench import add_client_args, client_config, default_out_dir, jsonable_args
from ops.capacity_report import (
    attainments,
    bisection_rate,
    capacity_of,
    rate_result,
    report_text,
)
from ops.client import (
    ClientConfig,
    RequestRecord,
    RequestSpec,
    discover_model,
    run_workload,
    set_policy,
)
from ops.compare import parse_policy
from ops.plots import plot_attainment
from ops.prompts import PromptMaker, load_codec
from ops.tool_main import run_tool

PROG = "cadence bench capacity"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="0.25,0.5,1,2", help="requests/s, comma separated")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a rate")
    parser.add_argument("--ttft-ms", type=float, default=3000.0, help="TTFT target")
    parser.add_argument(
        "--itl-p99-ms", default="250,500,1000", help="per-request p99 ITL targets, comma separated"
    )
    parser.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests that must meet a target"
    )
    parser.add_argument("--bisect", type=int, default=2, help="extra runs refining the capacity")
    parser.add_argument(
        "--bisect-target", type=float, help="the ITL target bisected (default: the middle one)"
    )
    parser.add_argument("--label", help="names the server in the output (e.g. vllm)")
    parser.add_argument(
        "--policy", action="append", help="repeat: NAME or NAME:{json params}; one sweep each"
    )
    parser.add_argument("--admin-token", help="bearer token of the admin API (for --policy)")
    parser.add_argument(
        "--merge", nargs="+", type=Path, metavar="DIR", help="report finished sweeps together"
    )
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="with --merge: judge the recorded requests against this command's SLO flags",
    )
    add_shape_args(parser)
    add_client_args(parser, slo=False)
    parser.set_defaults(timeout=300.0)
    return parser


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixed workload")
    group.add_argument("--prompt-median", type=int, default=256, help="chat prompt tokens")
    group.add_argument("--prompt-sigma", type=float, default=1.0, help="log-normal sigma")
    group.add_argument("--prompt-clip", default="16:2048", help="chat prompt tokens LO:HI")
    group.add_argument("--output-median", type=int, default=128, help="output tokens")
    group.add_argument("--output-sigma", type=float, default=0.8, help="log-normal sigma")
    group.add_argument("--output-clip", default="8:512", help="output tokens LO:HI")
    group.add_argument("--doc-share", type=float, default=0.1, help="share of long documents")
    group.add_argument("--doc-len", default="2000:4000", help="document prompt tokens LO:HI")
    group.add_argument(
        "--context-window", type=int, default=scenarios.CONTEXT_WINDOW, help="prompt + output"
    )


@dataclass(frozen=True, slots=True)
class Sweep:
    """What every sweep of one command measures, checked before any request is sent."""

    rates: list[float]
    duration_s: float
    seed: int
    shape: scenarios.MixedShape
    ttft_ms: float
    itl_targets: list[float]
    attainment: float
    bisect: int
    bisect_target: float


def parse_positive_floats(text: str, flag: str) -> list[float]:
    """`0.25,0.5,1`: sorted, distinct, all > 0."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a comma-separated list of numbers") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{flag} {text!r} needs one or more numbers > 0")
    return sorted(set(values))


def shape_from_args(args: argparse.Namespace) -> scenarios.MixedShape:
    lengths = scenarios.parse_length_range
    return scenarios.MixedShape(
        prompt=scenarios.LogNormal(
            args.prompt_median, args.prompt_sigma, lengths(args.prompt_clip)
        ),
        output=scenarios.LogNormal(
            args.output_median, args.output_sigma, lengths(args.output_clip)
        ),
        doc_share=args.doc_share,
        doc=lengths(args.doc_len),
        context_window=args.context_window,
    )


def sweep_from_args(args: argparse.Namespace) -> Sweep:
    """The sweep the flags describe; raises ValueError naming the flag at fault."""
    targets = parse_positive_floats(args.itl_p99_ms, "--itl-p99-ms")
    bisect_target = targets[len(targets) // 2] if args.bisect_target is None else args.bisect_target
    if bisect_target not in targets:
        raise ValueError(f"--bisect-target {bisect_target:g} is not one of --itl-p99-ms")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment {args.attainment:g} must be in (0, 1]")
    if args.duration <= 0 or args.bisect < 0:
        raise ValueError("--duration must be > 0 and --bisect >= 0")
    if args.policy and not args.admin_token:
        raise ValueError("--policy needs --admin-token")
    return Sweep(
        rates=parse_positive_floats(args.rates, "--rates"),
        duration_s=args.duration,
        seed=args.seed,
        shape=shape_from_args(args),
        ttft_ms=args.ttft_ms,
        itl_targets=targets,
        attainment=args.attainment,
        bisect=args.bisect,
        bisect_target=bisect_target,
    )


def workload(maker: PromptMaker, sweep: Sweep, rate: float) -> list[RequestSpec]:
    specs = scenarios.mixed(
        maker, random.Random(sweep.seed), rate=rate, duration_s=sweep.duration_s, shape=sweep.shape
    )
    if not specs:
        raise ValueError(
            f"no request arrives in {sweep.duration_s:g} s at {rate:g}/s: lengthen --duration"
        )
    return specs


async def run_rate(
    config: ClientConfig,
    sweep: Sweep,
    specs: list[RequestSpec],
    rate: float,
    name: str,
    bisection: bool,
) -> dict[str, Any]:
    print(f"[{name}] {rate:g} req/s: {len(specs)} requests ...", flush=True)
    result = await run_workload(config, specs)
    run = rate_result(result.records, rate, sweep.duration_s, sweep.ttft_ms, sweep.itl_targets)
    met = ", ".join(f"{t['itl_p99_ms']:g} ms {t['attainment']:.0%}" for t in run["targets"])
    print(f"[{name}] {rate:g} req/s: attainment {met}", flush=True)
    run["bisection"] = bisection
    run["started_unix"] = result.started_unix
    run["requests"] = [dataclasses.asdict(r) for r in result.records]
    return run


async def run_sweep(
    config: ClientConfig,
    maker: PromptMaker,
    sweep: Sweep,
    swept: dict[float, list[RequestSpec]],
    name: str,
) -> list[dict[str, Any]]:
    """The swept rates, then bisection runs while the bisected target has a bracket."""
    runs = []
    for rate, specs in swept.items():
        runs.append(await run_rate(config, sweep, specs, rate, name, bisection=False))
    for _ in range(sweep.bisect):
        rate = bisection_rate(attainments(runs, sweep.bisect_target), sweep.attainment)
        if rate is None:
            break
        specs = workload(maker, sweep, rate)
        runs.append(await run_rate(config, sweep, specs, rate, name, bisection=True))
    return sorted(runs, key=lambda run: run["rate"])


def capacities(runs: list[dict[str, Any]], sweep: Sweep) -> list[dict[str, Any]]:
    return [
        {"itl_p99_ms": t, **dataclasses.asdict(capacity_of(attainments(runs, t), sweep.attainment))}
        for t in sweep.itl_targets
    ]


def sweep_name(label: str | None, url: str, policy: tuple[str, dict] | None) -> str:
    if policy is None:
        return label or url
    return f"{label}/{policy[0]}" if label else policy[0]


async def run_all(
    args: argparse.Namespace,
    sweep: Sweep,
    policies: list[tuple[str, dict] | None],
    maker: PromptMaker,
) -> list[dict[str, Any]]:
    """One sweep per policy (one against whatever the server runs when `policies` is [None])."""
    swept = {rate: workload(maker, sweep, rate) for rate in sweep.rates}
    model = args.model or await discover_model(args.url, args.api_key)
    config = client_config(args.url, model, args)
    results = []
    for policy in policies:
        name = sweep_name(args.label, args.url, policy)
        if policy is not None:
            swap = await set_policy(args.url, policy[0], policy[1], args.admin_token)
            print(f"[{name}] policy set: {swap}", flush=True)
        runs = await run_sweep(config, maker, sweep, swept, name)
        results.append(
            {
                "name": name,
                "url": args.url,
                "model": model,
                "policy": None if policy is None else {"name": policy[0], "params": policy[1]},
                "slo": slo_settings(sweep),
                "runs": runs,
                "capacity": capacities(runs, sweep),
            }
        )
    return results


def slo_settings(sweep: Sweep) -> dict[str, Any]:
    return {
        "ttft_ms": sweep.ttft_ms,
        "itl_p99_ms": sweep.itl_targets,
        "attainment": sweep.attainment,
        "bisect_target": sweep.bisect_target,
    }


def write_report(sweeps: list[dict[str, Any]], out_dir: Path, plots: bool) -> str:
    """summary.txt and (with `plots`) attainment.png; returns the report text."""
    text = report_text(sweeps)
    (out_dir / "summary.txt").write_text(text + "\n")
    if plots:
        curves = {
            sweep["name"]: {t: attainments(sweep["runs"], t) for t in sweep["slo"]["itl_p99_ms"]}
            for sweep in sweeps
        }
        thresholds = [sweep["slo"]["attainment"] for sweep in sweeps]
        plot_attainment(curves, thresholds, out_dir / "attainment.png")
    return text


def load_sweeps(dirs: list[Path], rescored: Sweep | None = None) -> list[dict[str, Any]]:
    """Every sweep of every DIR/capacity.json; a name seen before gets its directory added.
    With `rescored`, each run's recorded requests are judged against its SLO instead."""
    sweeps, seen = [], set()
    for directory in dirs:
        path = directory / "capacity.json"
        try:
            document = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if not isinstance(document, dict) or not document.get("sweeps"):
            raise ValueError(f"{path} holds no capacity sweeps")
        for sweep in document["sweeps"]:
            if sweep["name"] in seen:
                sweep["name"] = f"{sweep['name']} ({directory.name})"
            seen.add(sweep["name"])
            if rescored is not None:
                sweep = rescore(sweep, document["workload"]["duration_s"], rescored)
            sweeps.append(sweep)
    return sweeps


def rescore(sweep: dict[str, Any], duration_s: float, slo: Sweep) -> dict[str, Any]:
    """The sweep's runs judged against another SLO, from their recorded requests."""
    runs = []
    for run in sweep["runs"]:
        records = [RequestRecord(**record) for record in run["requests"]]
        result = rate_result(records, run["rate"], duration_s, slo.ttft_ms, slo.itl_targets)
        runs.append({**run, **result})
    return {**sweep, "runs": runs, "slo": slo_settings(slo), "capacity": capacities(runs, slo)}


def rescored_slo(args: argparse.Namespace) -> Sweep | None:
    if not args.rescore:
        return None
    return sweep_from_args(argparse.Namespace(**{**vars(args), "policy": None}))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the sweeps; returns capacity.json's document."""
    sweep = sweep_from_args(args)
    policies = [parse_policy(p) for p in args.policy] if args.policy else [None]
    maker = PromptMaker(load_codec(args.tokenizer))
    return {
        "label": args.label,
        "config": jsonable_args(args),
        "workload": {
            "scenario": "mixed",
            "shape": dataclasses.asdict(sweep.shape),
            "duration_s": sweep.duration_s,
            "seed": sweep.seed,
            "tokenizer": args.tokenizer,
        },
        "sweeps": trio.run(run_all, args, sweep, policies, maker),
    }


def main(argv: list[str] | None = None) -> int:
    return run_tool(PROG, build_parser(), argv, sweeps_document, write_capacity)


def sweeps_document(args: argparse.Namespace) -> dict[str, Any]:
    """capacity.json's document: measured now, or merged from earlier runs."""
    if args.rescore and not args.merge:
        raise ValueError("--rescore needs --merge")
    if args.merge:
        return {"sweeps": load_sweeps(args.merge, rescored_slo(args))}
    return measure(args)


def write_capacity(args: argparse.Namespace, document: dict[str, Any]) -> int:
    out_dir: Path = args.out or default_out_dir("capacity-merge" if args.merge else "capacity")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.merge:
        (out_dir / "capacity.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    sweeps = document["sweeps"]
    print(write_report(sweeps, out_dir, plots=not args.no_plots))
    print(f"\nwrote {out_dir}")
    succeeded = [sum(run["summary"]["succeeded"] for run in s["runs"]) for s in sweeps]
    return 0 if all(succeeded) else 1
