"""`cadence logs report LOGFILE [--out DIR]`: a Markdown report with PNGs from a cadence log.

Per-iteration prefill vs decode tokens (policy swaps marked), step time and KV usage over
time, and per-request TTFT / ITL distributions by policy and by tenant. Damaged lines and
unknown events are skipped and counted in the report.
"""

from __future__ import annotations

import argparse
import operator
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ops.log_parse import FinishedRequest, ParsedLog, parse_log
from ops.log_plots import plot_iteration_tokens, plot_request_cdfs, plot_step_and_kv
from ops.summary import distribution


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if isinstance(value, float) else str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def overview(log: ParsedLog, source: Path) -> str:
    stamps = [r.ts for group in (log.iterations, log.swaps, log.requests) for r in group]
    span = max(stamps) - min(stamps) if stamps else 0.0
    rows = [
        ("log file", str(source)),
        ("non-empty lines", log.lines),
        ("time span (s)", span),
        ("iterations", len(log.iterations)),
        ("finished requests", len(log.requests)),
        ("policy swaps", len(log.swaps)),
        ("lines skipped", sum(log.skipped.values())),
        ("lines of other events", sum(log.other_events.values())),
    ]
    return markdown_table(["", ""], rows)


def skipped_section(log: ParsedLog) -> str:
    parts = ["## Lines not used"]
    if log.skipped:
        parts.append(markdown_table(["skipped because", "lines"], log.skipped.most_common()))
    else:
        parts.append("No damaged or unreadable lines.")
    if log.other_events:
        parts.append(
            markdown_table(["other event (not charted)", "lines"], log.other_events.most_common())
        )
    return "\n\n".join(parts)


def swaps_section(log: ParsedLog, t0: float) -> str:
    if not log.swaps:
        return "## Policy swaps\n\nNone."
    rows = [(s.ts - t0, s.iteration, s.old, s.new, s.by) for s in log.swaps]
    return "## Policy swaps\n\n" + markdown_table(["at s", "iteration", "old", "new", "by"], rows)


def iterations_section(log: ParsedLog, out_dir: Path, t0: float) -> str:
    if not log.iterations:
        return "## Iterations\n\nNo iteration lines."
    plot_iteration_tokens(log.iterations, log.swaps, t0, out_dir / "iteration_tokens.png")
    plot_step_and_kv(log.iterations, log.swaps, t0, out_dir / "step_and_kv.png")
    by_policy: dict[str, list] = {}
    for it in log.iterations:
        by_policy.setdefault(it.policy, []).append(it)
    rows = []
    for policy, its in sorted(by_policy.items()):
        step = distribution(it.step_ms for it in its)
        rows.append(
            (
                policy,
                len(its),
                sum(it.prefill_tokens for it in its),
                sum(it.decode_seqs for it in its),
                step["p50"],
                step["p99"],
                step["max"],
                max(it.kv_blocks_used / max(it.kv_blocks_total, 1) for it in its) * 100,
            )
        )
    table = markdown_table(
        [
            "policy",
            "iterations",
            "prefill tokens",
            "decode tokens",
            "step p50 ms",
            "step p99 ms",
            "step max ms",
            "KV peak %",
        ],
        rows,
    )
    return "\n\n".join(
        [
            "## Iterations",
            table,
            "![prefill vs decode tokens per iteration](iteration_tokens.png)",
            "![step time and KV usage](step_and_kv.png)",
        ]
    )


def request_rows(
    requests: Sequence[FinishedRequest], group_of: Callable[[FinishedRequest], str]
) -> list[tuple]:
    groups: dict[str, list[FinishedRequest]] = {}
    for r in requests:
        groups.setdefault(group_of(r), []).append(r)
    rows = []
    for name, members in sorted(groups.items()):
        ttft = distribution(r.ttft_ms for r in members if r.ttft_ms is not None)
        itl99 = distribution(r.itl_p99_ms for r in members if r.itl_p99_ms is not None)
        itl_max = [r.itl_max_ms for r in members if r.itl_max_ms is not None]
        reasons = Counter(r.finish_reason for r in members)
        rows.append(
            (
                name,
                len(members),
                ttft["p50"],
                ttft["p90"],
                ttft["p99"],
                ttft["max"],
                itl99["p50"],
                itl99["p99"],
                max(itl_max) if itl_max else None,
                ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())),
            )
        )
    return rows


def requests_section(log: ParsedLog, out_dir: Path, key: str) -> str:
    title = f"## Requests by {key}"
    if not log.requests:
        return f"{title}\n\nNo request.finished lines."
    group_of = operator.attrgetter(key)
    image = f"requests_by_{key}.png"
    plot_request_cdfs(log.requests, group_of, f"Requests by {key}", out_dir / image)
    headers = [
        key,
        "requests",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "TTFT max",
        "ITL p99 (median request)",
        "ITL p99 (p99 request)",
        "ITL max",
        "finish reasons",
    ]
    return "\n\n".join(
        [
            title,
            "Milliseconds. ITL columns summarise each request's own p99 / max gap.",
            markdown_table(headers, request_rows(log.requests, group_of)),
            f"![TTFT and ITL by {key}]({image})",
        ]
    )


def write_report(log: ParsedLog, source: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = log.start_ts or 0.0
    sections = [
        "# cadence log report",
        overview(log, source),
        skipped_section(log),
        swaps_section(log, t0),
        iterations_section(log, out_dir, t0),
        requests_section(log, out_dir, "policy"),
        requests_section(log, out_dir, "tenant"),
    ]
    path = out_dir / "report.md"
    path.write_text("\n\n".join(sections) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence logs report", description=__doc__)
    parser.add_argument("logfile", type=Path, help="a cadence JSON-lines log")
    parser.add_argument("--out", type=Path, help="output directory (default: LOGFILE-report)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        argv = argv[1:]  # `cadence logs report LOGFILE` hands us everything after `logs`
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if not args.logfile.is_file():
        print(f"cadence logs report: {args.logfile} is not a file", file=sys.stderr)
        return 2
    out_dir = args.out or args.logfile.with_name(args.logfile.name + "-report")
    try:
        log = parse_log(args.logfile)
        path = write_report(log, args.logfile, out_dir)
    except OSError as exc:
        print(f"cadence logs report: {exc}", file=sys.stderr)
        return 1
    skipped = sum(log.skipped.values())
    print(
        f"read {log.lines} lines ({len(log.iterations)} iterations, {len(log.requests)} "
        f"requests, {skipped} skipped); wrote {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
