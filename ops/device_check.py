"""The device check: one command that shows the worker correct, fast and serving on a GPU,
within one short loan of one.

    python -m ops.device_check OUT_DIR [--device cuda] [--quick] [--hbm-tbps 4.8]
                               [--wheels DIR] [--only SECTION ...]

Each section (SECTIONS) runs in a process of its own (`--section NAME`, this same script)
under its own timeout, so that a failure, a hang or a crashed CUDA context in one never
hides the others; the timeouts of the full run add up to 7.5 minutes. OUT_DIR/report.json
and report.md are written before and after every section: a run cut short still says what
it found. A section's output is relayed as it comes, and kept in OUT_DIR/logs. It exits 1
when a check failed, timed out or crashed. `--only` runs some sections again, keeping the
others' results from OUT_DIR's last report.

The sections (ops.device_sections) build random-weight Llama and Qwen2 models with
transformers (no downloads) in the work folder, and import gpu_worker, torch, transformers
and numpy only: a GPU host may lack the service's dependencies. `serve_http` starts the
real service, installing them first from a folder of wheels when given `--wheels`
(`--requirements` prints what that folder must hold). `--device cpu --quick` runs tiny
models and a few rows on a CPU: the test suite runs it, so that the script is known to run
unchanged on the first GPU host.

The runner imports no torch: the sections' processes do (ops.device_sections, with the
steps of ops.worker_steps); the report is ops.device_report's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ops.device_report import ROOT, result_path, say, write_report

TAIL_LINES = 40  # of a section's output, kept in the report when it did not pass
QUICK_TIMEOUT_S = 240  # a CPU section's: CI machines vary; the budget is the GPU's


@dataclass(frozen=True, slots=True)
class Section:
    name: str  # also the function that runs it, in `module`
    timeout_s: int  # on the GPU
    shows: str
    module: str = "ops.device_sections"


SECTIONS = (
    Section("environment", 15, "versions, the GPU, its capability and driver"),
    Section("machine", 25, "measured copy bandwidth and bf16 matmul rate"),
    Section(
        "flex_probes",
        70,
        "short chunks at every GQA group, decode kernels, graph replay",
        "ops.device_probes",
    ),
    Section("logits_vs_transformers", 55, "last logits against transformers, fp32 and bf16"),
    Section("chunked_vs_unchunked", 20, "a prompt in chunks against in one step"),
    Section("mixed_vs_alone", 30, "a sequence decoded beside others against alone"),
    Section("graphs_on_vs_off", 30, "greedy tokens with CUDA graphs and without"),
    Section("long_prompt", 20, "a long prompt in chunks beside decoders"),
    Section("sampler_with_seeds", 15, "seeded sampling across rows and runs"),
    Section("decode_timings", 70, "step times beside their rooflines; the KV memory taken"),
    Section("transformers_generate", 30, "the same weights through transformers.generate"),
    Section(
        "serve_http",
        70,
        "`cadence serve` answering a chat completion over HTTP",
        "ops.device_serve",
    ),
)
SECTION_NAMES = tuple(section.name for section in SECTIONS)


# ---- running the sections -----------------------------------------------------------------


def run_sections(
    sections: list[Section],
    command_of: Callable[[Section], list[str]],
    out: Path,
    report: dict[str, Any],
    timeout_of: Callable[[Section], float] = lambda section: section.timeout_s,
) -> dict[str, Any]:
    """Runs each section's command in turn, recording each in `report` and writing the
    report before and after each one."""
    for section in sections:
        timeout = timeout_of(section)
        say(f"== {section.name} (at most {timeout:g} s): {section.shows}")
        report["sections"][section.name] = {"status": "running", "ok": False, "timeout_s": timeout}
        write_report(out, report)
        record = run_section(section.name, command_of(section), out, timeout)
        report["sections"][section.name] = record
        say(f"== {section.name}: {record['status']} in {record['seconds']} s")
        write_report(out, report)
    return report


def run_section(name: str, command: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """Runs one section's process (its own process group) for at most `timeout` seconds,
    relaying its output; its record: status, seconds, its result, and the tail of its
    output where it did not pass."""
    path = result_path(out, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    started = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    assert process.stdout is not None
    relay = threading.Thread(target=_relay, args=(process.stdout, log, tail), daemon=True)
    relay.start()
    timed_out = False
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_group(process)  # what it started and left behind (a server, compile workers)
    code = process.wait()
    relay.join(5)
    seconds = round(time.monotonic() - started, 1)
    return _record(_read_json(path), code, timed_out, seconds, timeout, list(tail))


def _relay(stream: IO[bytes], log: Path, tail: deque[str]) -> None:
    with log.open("wb") as kept:
        for line in iter(stream.readline, b""):
            kept.write(line)
            text = line.decode(errors="replace").rstrip("\n")
            tail.append(text)
            print(f"  {text}", flush=True)


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _record(
    result: dict[str, Any] | None,
    code: int,
    timed_out: bool,
    seconds: float,
    timeout: float,
    tail: list[str],
) -> dict[str, Any]:
    if timed_out:
        status = "timed out"
    elif result is None:
        status = f"crashed (exit {code})" if code >= 0 else f"crashed (signal {-code})"
    elif "skipped" in result:
        status = "skipped"
    else:
        status = "passed" if result.get("ok") and code == 0 else "failed"
    record = {
        "status": status,
        "ok": status in ("passed", "skipped"),
        "seconds": seconds,
        "timeout_s": timeout,
        "result": result,
    }
    if not record["ok"]:
        record["tail"] = "\n".join(tail)
    return record


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_child(name: str, args: argparse.Namespace) -> int:
    """The process of one section: its result, or its error, in result_path."""
    from ops.device_sections import Context

    section = next(section for section in SECTIONS if section.name == name)
    started = time.perf_counter()
    try:
        run: Callable[[Context], dict[str, Any]]
        run = getattr(importlib.import_module(section.module), section.name)
        result = run(Context.of(args))
    except Exception:  # the section's failure is its result
        result = {"ok": False, "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr, flush=True)
    result["section_seconds"] = round(time.perf_counter() - started, 1)
    path = result_path(args.out_dir, name)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result.get("ok") else 1


# ---- the command --------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(
        prog="python -m ops.device_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    found.add_argument("out_dir", type=Path, nargs="?")
    found.add_argument("--device", default="cuda")
    found.add_argument("--quick", action="store_true", help="tiny models, a few rows")
    found.add_argument("--kernels", default="auto", help="as the worker's --kernels")
    found.add_argument("--hbm-tbps", type=float, default=4.8, help="nominal; H200: 4.8 TB/s")
    found.add_argument(
        "--matmul-tflops", type=float, default=989.0, help="nominal bf16; H200: 989 TFLOP/s"
    )
    found.add_argument("--wheels", type=Path, help="a folder of the service's wheels")
    found.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "cadence-device-check",
        help="where the models and the installed wheels go (default: %(default)s)",
    )
    found.add_argument("--only", nargs="+", choices=SECTION_NAMES, metavar="SECTION")
    found.add_argument("--section", choices=SECTION_NAMES, help=argparse.SUPPRESS)
    found.add_argument(
        "--requirements", action="store_true", help="print what --wheels must hold, and exit"
    )
    return found


def child_command(args: argparse.Namespace, section: Section) -> list[str]:
    """The command of `section`'s process: this script, with the run's settings."""
    command = [sys.executable, "-m", "ops.device_check", str(args.out_dir)]
    command += ["--section", section.name, "--device", args.device, "--kernels", args.kernels]
    command += ["--hbm-tbps", str(args.hbm_tbps), "--matmul-tflops", str(args.matmul_tflops)]
    command += ["--work", str(args.work)] + (["--quick"] if args.quick else [])
    return command + (["--wheels", str(args.wheels)] if args.wheels else [])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.requirements:
        from ops.device_serve import service_requirements

        print("\n".join(service_requirements()))
        return 0
    if args.out_dir is None:
        parser().error("OUT_DIR is required")
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.work = args.work.resolve()
    if args.section:
        return run_child(args.section, args)
    chosen = [s for s in SECTIONS if args.only is None or s.name in args.only]
    report: dict[str, Any] = {"device": args.device, "quick": args.quick, "sections": {}}
    if args.only:  # the other sections' results stay as the last run left them
        earlier = _read_json(args.out_dir / "report.json") or {}
        report["sections"] = earlier.get("sections", {})
    started = time.monotonic()
    report = run_sections(
        chosen,
        lambda section: child_command(args, section),
        args.out_dir,
        report,
        lambda section: QUICK_TIMEOUT_S if args.quick else section.timeout_s,
    )
    report["seconds"] = round(time.monotonic() - started, 1)
    write_report(args.out_dir, report)
    say(f"report: {args.out_dir / 'report.md'}; passed: {report['passed']}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
