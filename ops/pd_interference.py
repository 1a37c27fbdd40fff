"""`cadence bench pd-interference`: the interference scenario against disaggregated prefill
and decode and against one colocated server, side by side (issue 55).

    cadence bench pd-interference [--dtype bfloat16] [--cpu-threads 1]
        [--colocated-cpu-threads 2] [--kv-memory 1.5e9] [--decoders 4]
        [--decoder-tokens 800] [--inject 1024@3,4096@8] [--quick] [-- SERVE FLAGS]

It starts `cadence pd` (a producer, a consumer and vllm-router) and one `cadence serve
--policy stall_free`, side by side, then runs `cadence bench interference`'s workload
against each in turn (the other idle): the decoders alone first (the baseline), then the
same decoders with the long prompts injected while they stream. Through the pair the
injected prompts are computed by the producer, so the consumer's streams should not see
them at all: its worst gap at most 1.2x its baseline's (issue 55). The colocated server
computes them in chunks beside its streams (stall_free): its worst gap is bounded by one
budget-sized step, and the long prompts' TTFT is the other side of the trade, so both are
printed. SERVE FLAGS (after `--`) go to all three servers.

On a CPU the servers share its cores: each of the pair's workers takes --cpu-threads, the
colocated one --colocated-cpu-threads (by default as many as the pair's together, so both
setups compute on the same cores), and the notes under the table say so. Run it on a quiet
machine: another process on those cores shows as gaps.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson
import trio

from ops.bench import (
    BenchRun,
    add_client_args,
    add_workload_args,
    default_out_dir,
    execute,
    prepare_specs,
    write_run,
)
from ops.client import RequestSpec
from ops.summary import format_table
from service.flag_types import positive_int
from service.pd_launch import (
    Child,
    FirstExit,
    LaunchError,
    drain,
    read_url,
    split_at_dashes,
    start_child,
    wait_ready,
)

PROG = "cadence bench pd-interference"
PD_READY = re.compile(rb"ready at (\S+);")  # the line `cadence pd` prints once all three run
STOP_TIMEOUT_S = 15.0  # SIGTERM, then SIGKILL this long after (cadence pd's own default)
# --quick: a few seconds of work (tests/test_ops_pd_interference.py)
QUICK = {
    "decoders": 2,
    "decoder_prompt_len": 16,
    "decoder_tokens": 128,
    "inject": "64@0.2,256@0.5",
    "injected_tokens": 2,
    "kv_memory": 192 * 1024 * 1024,
}


@dataclass(slots=True)
class Setup:
    """One way of serving: its name, where the client sends, what it is."""

    name: str
    url: str
    what: str  # the command and how it shares the cores


@dataclass(slots=True)
class Measured:
    setup: Setup
    baseline: BenchRun  # the decoders alone
    injected: BenchRun  # the same decoders, the long prompts injected meanwhile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    servers = parser.add_argument_group("servers")
    servers.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    servers.add_argument(
        "--cpu-threads", type=positive_int, default=1, help="each of the pair's workers"
    )
    servers.add_argument(
        "--colocated-cpu-threads", type=positive_int, help="the colocated worker's (default: 2x)"
    )
    servers.add_argument("--kv-memory", type=float, default=1.5e9, help="bytes, each server")
    servers.add_argument("--log-dir", type=Path, help="the servers' logs (default: --out/logs)")
    servers.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    add_workload_args(parser, "interference")
    add_client_args(parser, single_url=False)
    parser.set_defaults(inject="1024@3,4096@8", decoder_tokens=800)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    ours, serve_args = split_at_dashes(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(ours)
    if args.quick:
        vars(args).update(QUICK)
    args.colocated_cpu_threads = args.colocated_cpu_threads or 2 * args.cpu_threads
    args.out = args.out or default_out_dir("pd-interference")
    args.log_dir = args.log_dir or args.out / "logs"
    args.serve_args = serve_args
    return args


def serve_flags(args: argparse.Namespace, threads: int) -> list[str]:
    return ["--dtype", args.dtype, "--kv-memory", str(args.kv_memory),
            "--cpu-threads", str(threads), *args.serve_args]  # fmt: skip


def pd_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "service.cli", "pd", "--port", "0",
            "--log-dir", str(args.log_dir), "--startup-timeout", str(args.startup_timeout),
            "--", *serve_flags(args, args.cpu_threads)]  # fmt: skip


def colocated_command(args: argparse.Namespace) -> list[str]:
    log_file = args.log_dir / "colocated.log"
    return [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--policy",
            "stall_free", "--log-file", str(log_file),
            *serve_flags(args, args.colocated_cpu_threads)]  # fmt: skip


async def read_pd_url(child: Child, nursery: trio.Nursery, timeout: float) -> str:
    """The router's URL, from the line `cadence pd` prints once all three run."""
    stdout = child.process.stdout
    assert stdout is not None
    buffered = b""
    with trio.move_on_after(timeout):
        while not (found := PD_READY.search(buffered)):
            chunk = await stdout.receive_some()
            if not chunk:
                raise LaunchError("cadence pd exited before it was ready")
            buffered += chunk
        nursery.start_soon(drain, stdout)
        return found[1].decode()
    raise LaunchError(f"cadence pd not ready after {timeout} s")


async def start_setups(
    nursery: trio.Nursery, args: argparse.Namespace, stderr: IO[bytes], first_exit: FirstExit
) -> list[Setup]:
    """`cadence pd` and the colocated server, loading side by side, once both answer."""
    start = [
        (name, command, subprocess.PIPE, stderr, STOP_TIMEOUT_S, first_exit)
        for name, command in (("pd", pd_command(args)), ("colocated", colocated_command(args)))
    ]
    pd, colocated = [await start_child(nursery, *each) for each in start]
    colocated.url = await read_url(colocated, nursery, args.startup_timeout)
    pd.url = await read_pd_url(pd, nursery, args.startup_timeout)
    await wait_ready(colocated, f"{colocated.url}/health", args.startup_timeout)
    return [
        Setup(
            "pd",
            pd.url,
            "cadence pd (producer, consumer, vllm-router): each server's worker "
            f"--cpu-threads {args.cpu_threads}",
        ),
        Setup(
            "colocated",
            colocated.url,
            f"cadence serve --policy stall_free: its worker --cpu-threads "
            f"{args.colocated_cpu_threads}",
        ),
    ]


async def measure_setup(
    setup: Setup, specs: list[RequestSpec], args: argparse.Namespace
) -> Measured:
    decoders = [spec for spec in specs if spec.role == "decoder"]
    print(f"[{setup.name}] baseline: {len(decoders)} decoders alone ...", flush=True)
    baseline = await execute(setup.url, f"{setup.name} baseline", decoders, args)
    print(f"[{setup.name}] injecting {args.inject} ...", flush=True)
    injected = await execute(setup.url, f"{setup.name} injected", specs, args)
    return Measured(setup, baseline, injected)


async def measure_all(args: argparse.Namespace) -> list[Measured]:
    specs = prepare_specs("interference", args)
    first_exit = FirstExit()
    measured = []
    args.log_dir.mkdir(parents=True, exist_ok=True)
    with open(args.log_dir / "launch.stderr", "ab") as stderr:  # both commands' own lines
        async with trio.open_nursery() as nursery:
            setups = await start_setups(nursery, args, stderr, first_exit)
            for setup in setups:  # one at a time: the other idles
                measured.append(await measure_setup(setup, specs, args))
            nursery.cancel_scope.cancel()  # stops them (SIGTERM; the pair stops its three)
    if first_exit.returncode is not None:
        raise LaunchError(f"{first_exit.name} exited with {first_exit.returncode}")
    return measured


def measured_runs(args: argparse.Namespace) -> list[Measured]:
    return trio.run(measure_all, args)


def worst_gap_ms(run: BenchRun) -> float | None:
    """The decoders' largest gap between two tokens over the whole run."""
    return run.groups["decoder"]["itl_ms"]["max"]


def table_rows(measured: list[Measured]) -> list[list[Any]]:
    rows = []
    for each in measured:
        base, injections = worst_gap_ms(each.baseline), len(each.injected.windows)
        for phase, run in (("baseline", each.baseline), ("injected", each.injected)):
            gap, itl = worst_gap_ms(run), run.groups["decoder"]["itl_ms"]
            ratio = None if gap is None or not base else f"{gap / base:.2f}"
            ttfts = [w["injected_ttft_ms"] for w in run.windows] or [None] * injections
            rows.append([each.setup.name, phase, gap, ratio, itl["p50"], itl["p99"], *ttfts])
    return rows


def report_table(measured: list[Measured]) -> str:
    injected = [w["prompt_len"] for w in measured[0].injected.windows]
    headers = ["setup", "run", "worst gap ms", "gap / baseline", "ITL p50 ms", "ITL p99 ms"]
    headers += [f"TTFT {length} ms" for length in injected]
    return format_table(headers, table_rows(measured))


def notes(args: argparse.Namespace, measured: list[Measured]) -> list[str]:
    lines = [f"{m.setup.name}: {m.setup.what}, at {m.setup.url}" for m in measured]
    lines.append(
        f"decoders: {args.decoders} x {args.decoder_tokens} tokens; injected {args.inject} "
        f"({args.dtype}); gaps and ITL are the decoders' (client side)"
    )
    for m in measured:
        lines += [
            f"note: [{m.setup.name}] no decoder was streaming while the {w['prompt_len']}-token "
            "prompt was computed; give the decoders more --decoder-tokens"
            for w in m.injected.windows
            if w["decoders_active"] == 0
        ]
    failed = [r.label for m in measured for r in (m.baseline, m.injected) if r.summary["failed"]]
    lines += [f"failed requests in: {', '.join(failed)}"] if failed else []
    return lines


def write_report(args: argparse.Namespace, measured: list[Measured]) -> int:
    text = "\n".join([report_table(measured), "", *notes(args, measured)])
    for m in measured:
        for run in (m.baseline, m.injected):
            write_run(run, "interference", args, args.out / run.label.replace(" ", "-"))
    (args.out / "pd-interference.txt").write_text(text + "\n")
    document = {
        m.setup.name: {
            "url": m.setup.url,
            "what": m.setup.what,
            "baseline": _run_record(m.baseline),
            "injected": _run_record(m.injected),
        }
        for m in measured
    }
    path = args.out / "pd-interference.json"
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    print(text)
    print(f"\nwrote {path}")
    ok = all(r.summary["failed"] == 0 for m in measured for r in (m.baseline, m.injected))
    return 0 if ok else 1


def _run_record(run: BenchRun) -> dict[str, Any]:
    return {
        "worst_gap_ms": worst_gap_ms(run),
        "decoders": run.groups["decoder"],
        "interference": run.windows,
    }


def main(argv: list[str] | None = None) -> int:
    """0, or 1 when requests failed or a server would not start or stopped; 2 for bad flags."""
    try:
        args = parse(argv)
    except SystemExit as exc:  # --help or a usage error, already printed by argparse
        return int(exc.code or 0)
    measured, failed = [], 0
    try:
        measured = measured_runs(args)
    except* ValueError as group:  # a bad knob: --inject, the tokenizer
        failed = _fail(group, 2)
    except* LaunchError as group:
        failed = _fail(group, 1)
    return failed or write_report(args, measured)


def _fail(group: BaseExceptionGroup, code: int) -> int:
    for exc in group.exceptions:
        print(f"{PROG}: {exc}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
