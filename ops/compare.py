"""`cadence bench compare`: one workload, same seed, against several servers in turn.

    cadence bench compare --scenario interference --url http://a:8000 --url http://b:8000 \
        [--label A --label B] [--policy fcfs --policy stall_free --admin-token T]

Repeating one URL with different --policy entries compares policies on one server (the
policy is set through PUT /admin/policy before that entry's run). Prints one table with
each entry's numbers and their ratio to the first entry.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson
import trio

from ops import scenarios
from ops.bench import (
    BenchRun,
    add_client_args,
    add_workload_args,
    default_out_dir,
    execute,
    prepare_specs,
    write_run,
)
from ops.client import RequestSpec, set_policy
from ops.plots import plot_itl_cdf
from ops.summary import format_table
from ops.tool_main import run_tool


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence bench compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scenario", required=True, choices=scenarios.SCENARIOS)
    parser.add_argument("--url", action="append", required=True, help="repeat: one per entry")
    parser.add_argument("--label", action="append", help="repeat: one per --url")
    parser.add_argument(
        "--policy",
        action="append",
        help="repeat: NAME or NAME:{json params} or '-' (leave as is), per --url",
    )
    parser.add_argument("--admin-token", help="bearer token of the admin API (for --policy)")
    add_workload_args(parser, None)
    add_client_args(parser, single_url=False)
    return parser


def parse_policy(text: str | None) -> tuple[str, dict] | None:
    if text is None or text == "-":
        return None
    name, _, params = text.partition(":")
    try:
        parsed = orjson.loads(params) if params else {}
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"policy params of {text!r} are not JSON: {exc}") from None
    if not name or not isinstance(parsed, dict):
        raise ValueError(f"policy {text!r} is not NAME or NAME:{{json object}}")
    return name, parsed


def entries(args: argparse.Namespace) -> list[tuple[str, str, tuple[str, dict] | None]]:
    """(url, label, policy) for each --url, checking that the per-entry lists line up."""
    count = len(args.url)
    labels = args.label or []
    policies = args.policy or []
    for flag, values in (("--label", labels), ("--policy", policies)):
        if values and len(values) != count:
            raise ValueError(f"give {flag} once per --url ({count}), got {len(values)}")
    result = []
    for i, url in enumerate(args.url):
        policy = parse_policy(policies[i]) if policies else None
        label = labels[i] if labels else (url if policy is None else policy[0])
        result.append((url, label, policy))
    if len({label for _, label, _ in result}) != count:
        raise ValueError("entries need distinct labels (pass --label)")
    return result


COMPARED: list[tuple[str, tuple[str, ...]]] = [
    ("output tokens/s", ("output_tokens_per_s",)),
    ("requests/s", ("requests_per_s",)),
    ("goodput req/s", ("goodput_requests_per_s",)),
    ("failed", ("failed",)),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("ITL p50 ms", ("itl_ms", "p50")),
    ("ITL p99 ms", ("itl_ms", "p99")),
    ("ITL max ms", ("itl_ms", "max")),
    ("TPOT p50 ms", ("tpot_ms", "p50")),
    ("E2E p50 ms", ("e2e_ms", "p50")),
]


def _dig(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def compared_rows(run: BenchRun) -> list[tuple[str, Any]]:
    rows = [(name, _dig(run.summary, path)) for name, path in COMPARED]
    for w in run.windows:
        rows.append((f"decoder ITL max during {w['prompt_len']}", w["decoder_itl_ms"]["max"]))
        rows.append((f"decoder ITL p99 during {w['prompt_len']}", w["decoder_itl_ms"]["p99"]))
        rows.append((f"TTFT of injected {w['prompt_len']}", w["injected_ttft_ms"]))
    return rows


def ratio(value: Any, base: Any) -> float | None:
    if not isinstance(value, int | float) or not isinstance(base, int | float) or base == 0:
        return None
    return value / base


def comparison_table(runs: list[BenchRun]) -> str:
    columns = [compared_rows(run) for run in runs]
    headers = ["measure", *(run.label for run in runs)]
    headers += [f"{run.label} / {runs[0].label}" for run in runs[1:]]
    table = []
    for i, (name, base) in enumerate(columns[0]):
        values = [column[i][1] if i < len(column) else None for column in columns]
        ratios = [ratio(v, base) for v in values[1:]]
        table.append([name, *values, *(None if r is None else f"{r:.2f}" for r in ratios)])
    return format_table(headers, table)


async def run_all(
    plan: list[tuple[str, str, tuple[str, dict] | None]],
    specs: list[RequestSpec],
    args: argparse.Namespace,
) -> list[BenchRun]:
    runs = []
    for url, label, policy in plan:
        if policy is not None:
            swap = await set_policy(url, policy[0], policy[1], args.admin_token)
            print(f"[{label}] policy set: {swap}", flush=True)
        print(f"[{label}] running {len(specs)} requests against {url} ...", flush=True)
        runs.append(await execute(url, label, specs, args))
    return runs


def safe_dir_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def main(argv: list[str] | None = None) -> int:
    return run_tool("cadence bench compare", build_parser(), argv, measured_runs, write_compare)


def measured_runs(args: argparse.Namespace) -> list[BenchRun]:
    plan = entries(args)
    specs = prepare_specs(args.scenario, args)
    return trio.run(run_all, plan, specs, args)


def write_compare(args: argparse.Namespace, runs: list[BenchRun]) -> int:
    out_dir: Path = args.out or default_out_dir(f"compare-{args.scenario}")
    for run in runs:
        write_run(run, args.scenario, args, out_dir / safe_dir_name(run.label))
    table = comparison_table(runs)
    (out_dir / "compare.txt").write_text(table + "\n")
    (out_dir / "compare.json").write_bytes(
        orjson.dumps(
            {
                "scenario": args.scenario,
                "entries": [
                    {
                        "label": r.label,
                        "url": r.url,
                        "model": r.model,
                        "summary": r.summary,
                        "interference": r.windows,
                    }
                    for r in runs
                ],
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    if not args.no_plots:
        plot_itl_cdf({run.label: run.result.records for run in runs}, out_dir / "itl_cdf.png")
    print(table)
    print(f"\nwrote {out_dir}/compare.json")
    return 0 if all(run.summary["succeeded"] for run in runs) else 1
