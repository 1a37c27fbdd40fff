"""The device check: one command that shows the worker correct, fast and serving on a GPU,
and where a decode step's time goes, within one short loan of one.

    python -m ops.device_check OUT_DIR [--device cuda] [--quick] [--hbm-tbps 4.8]
                               [--wheels DIR] [--only SECTION ...] [--deadline-s 480]

On the H200, from the repository's root (a copy of the working tree; the host's Python has
torch, triton and transformers), the one command, within the device tool's 10 minutes:

    timeout 570 python -m ops.device_check /tmp/check --device cuda --wheels wheels/; rc=$?;
    cp /tmp/check/report.md /tmp/check/report.json $OUT/;
    tar czf $OUT/check-logs.tar.gz -C /tmp/check logs sections; exit $rc

`wheels/` is a folder of the service's wheels carried beside the tree (README: Device
check; without `--wheels` only the service's sections are skipped). $OUT then holds report.md (the
tables), report.json (the same, whole) and check-logs.tar.gz (each process's output and
each section's result JSON): three files, within what the device tool brings back. The run
keeps to a deadline of 8 minutes (`--deadline-s`), so the copies run whatever it finds.

Sections run in processes of their own (`--sections NAME ...`, this same script), so that
a failure, a hang or a crashed CUDA context in one never hides the others. The agreement
sections (AGREEMENT) share one process and its check-model workers, each still recorded
as a section of its own: a worker started is reused by the sections after it; so do the
service's (SERVICE) with one server. A section's
clock starts when the one before it in its process wrote its result (the first one's when
its process started, imports included), and it is killed at its timeout, about 1.5 times
the seconds it took on the H200; the sections after it in that process start again in a
fresh one. A section whose process wrote its result and then outlived its timeout is
"passed (slow exit)": a child exits with os._exit as soon as its results are written,
skipping the teardown of Inductor's compile workers and of a CUDA context that holds a
large KV cache. A section is given at most what is left of the run's deadline, and is
skipped, saying so, when less than MIN_SECTION_S is left.

OUT_DIR/report.json and report.md are written before and after every section: a run cut
short still says what it found. A process's output is relayed as it comes, and kept in
OUT_DIR/logs. It exits 1 when a check failed, timed out, crashed or was skipped for the
deadline. `--only` runs some sections again, keeping the others' results from OUT_DIR's
last report.

The sections (ops.device_sections: agreement; ops.device_probes: probes and decode
timings) build random-weight Llama and Qwen2 models with transformers (no downloads) in the
work folder, and import gpu_worker, torch, transformers and numpy only: a GPU host may lack
the service's dependencies. `serve_http` (ops.device_serve) starts the real service with
the timing model, installing them first from a folder of wheels when given `--wheels`
(`--requirements` prints what that folder must hold, ops.device_wheels); `interference`
and `capacity` (ops.device_promise) put cadence's headline scenario and a capacity sweep
on that same server. `--device cpu --quick` runs tiny
models and a few rows on a CPU, through the same code as on a GPU wherever a CPU can run
it: the test suite runs it, so that the script is known to run unchanged on a GPU host.

The runner imports no torch, and neither does `--requirements`; the report is
ops.device_report's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
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

STARTED = time.perf_counter()  # a section process's clock: its imports count in its first
TAIL_LINES = 40  # of a process's output, kept in the report for a section that did not pass
QUICK_TIMEOUT_S = 240  # a CPU section's: CI machines vary; the budget is the GPU's
TIMEOUT_FACTOR = 1.5  # a section's timeout over its seconds on the H200
MIN_TIMEOUT_S = 15  # imports alone vary by a few seconds
MIN_SECTION_S = 10  # less left of the deadline than this: the section is skipped
DEADLINE_S = 480  # the whole run's, by default: 8 minutes, within the device tool's 10
POLL_S = 0.2  # how often the runner looks for a running process's results
AGREEMENT = "agreement"  # the group of sections that share a process and its workers
SERVICE = "service"  # the group of sections that share a process and its server


@dataclass(frozen=True, slots=True)
class Section:
    name: str  # also the function that runs it, in `module`
    expected_s: float  # its seconds on the H200, its process's start included (see SECTIONS)
    shows: str
    module: str = "ops.device_sections"
    group: str | None = None  # consecutive sections of one group run in one process

    @property
    def timeout_s(self) -> int:
        """On the GPU: about TIMEOUT_FACTOR times its seconds there, in whole 5 s."""
        return max(MIN_TIMEOUT_S, 5 * math.ceil(TIMEOUT_FACTOR * self.expected_s / 5))


# Seconds as the H200 runs of early December measured them (shared/gpu/device-report-h200-*),
# imports and worker starts included: the agreement sections' each alone in a fresh process
# (its section_seconds there, plus the 5 s of imports they left out, without the teardown
# that os._exit now skips), as one needs when it runs again after a crash; in their shared
# process they take less. flex_probes and decode_timings have rows added since (event and
# graph timings, the profile and the floors): estimated. The service's sections share one
# process and one server: serve_http starts it, with the 1B model on a GPU (the 4-layer
# model's start took 37 s there; estimated), the promise sections load it (estimated from
# their load: about 5-6 s a policy, and 3 rates of 3 s of arrivals and their drain).
SECTIONS = (
    Section("environment", 6, "versions, the GPU, its capability and driver, nvcc"),
    Section("machine", 5, "measured copy bandwidth and bf16 matmul rate"),
    Section(
        "flex_probes",
        45,
        "short chunks at every GQA group, decode kernels timed eagerly and from graphs",
        "ops.device_probes",
    ),
    Section(
        "decode_timings",
        55,
        "step times beside their rooflines; where a decode step's time goes; the KV memory",
        "ops.device_probes",
    ),
    Section(
        "logits_vs_transformers",
        57,
        "last logits against transformers, fp32 and bf16",
        group=AGREEMENT,
    ),
    Section("chunked_vs_unchunked", 21, "a prompt in chunks against in one step", group=AGREEMENT),
    Section(
        "mixed_vs_alone", 23, "a sequence decoded beside others against alone", group=AGREEMENT
    ),
    Section("graphs_on_vs_off", 24, "greedy tokens with CUDA graphs and without", group=AGREEMENT),
    Section("long_prompt", 22, "a long prompt in chunks beside decoders", group=AGREEMENT),
    Section("sampler_with_seeds", 20, "seeded sampling across rows and runs", group=AGREEMENT),
    Section(
        "serve_http",
        42,
        "`cadence serve` answering a chat completion over HTTP",
        "ops.device_serve",
        group=SERVICE,
    ),
    Section(
        "interference",
        25,
        "streams decoding while long prompts arrive, under fcfs and stall_free: worst gaps",
        "ops.device_promise",
        group=SERVICE,
    ),
    Section(
        "capacity",
        20,
        "a mixed load at three rates under stall_free: SLO attainment",
        "ops.device_promise",
        group=SERVICE,
    ),
    Section("transformers_generate", 18, "the same weights through transformers.generate"),
)
SECTION_NAMES = tuple(section.name for section in SECTIONS)


# ---- running the sections -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Deadline:
    """When the whole run must end: a section is given at most what is left of it."""

    ends: float  # time.monotonic()

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.ends - time.monotonic()

    def allow(self, timeout: float) -> float | None:
        """The timeout a section starting now gets; None when too little is left to try."""
        left = self.left()
        if left < MIN_SECTION_S:
            return None
        return timeout if timeout <= left else math.floor(left)


NO_DEADLINE = Deadline(math.inf)
Command = Callable[[list[Section]], list[str]]  # the process that runs these sections


def run_sections(
    sections: list[Section],
    command_of: Command,
    out: Path,
    report: dict[str, Any],
    timeout_of: Callable[[Section], float] = lambda section: section.timeout_s,
    deadline: Deadline = NO_DEADLINE,
) -> dict[str, Any]:
    """Runs the sections in turn, those of a group in one process, recording each in
    `report` and writing the report before and after each one."""
    runs = SectionRuns(command_of, out, report, timeout_of, deadline)
    for batch in batches(sections):
        pending = batch
        while pending:  # a process that ended early leaves the rest to a fresh one
            pending = pending[runs.run_process(pending) :]
    return report


def batches(sections: list[Section]) -> list[list[Section]]:
    """Consecutive sections of one group together; every other section alone."""
    found: list[list[Section]] = []
    for section in sections:
        if found and section.group is not None and found[-1][-1].group == section.group:
            found[-1].append(section)
        else:
            found.append([section])
    return found


class SectionRuns:
    """Runs processes of sections, recording each section as it ends."""

    def __init__(
        self,
        command_of: Command,
        out: Path,
        report: dict[str, Any],
        timeout_of: Callable[[Section], float],
        deadline: Deadline,
    ) -> None:
        self.command_of = command_of
        self.out = out
        self.report = report
        self.timeout_of = timeout_of
        self.deadline = deadline

    def run_process(self, sections: list[Section]) -> int:
        """Runs `sections` in one process, in order, each under its own timeout; how many
        it recorded (at least the first): those after a section that timed out or crashed
        are left to the caller."""
        if self.deadline.allow(self.timeout_of(sections[0])) is None:
            for section in sections:
                self._skip(section)
            return len(sections)
        for section in sections:
            result_path(self.out, section.name).unlink(missing_ok=True)
        process = SectionProcess(self.command_of(sections), self.out, sections[0].name)
        try:
            return self._watch(process, sections)
        finally:
            process.stop()

    def _watch(self, process: SectionProcess, sections: list[Section]) -> int:
        started = process.started
        for index, section in enumerate(sections):
            timeout = self.deadline.allow(self.timeout_of(section))
            if timeout is None:
                for later in sections[index:]:
                    self._skip(later)
                return len(sections)
            self._running(section, timeout)
            path = result_path(self.out, section.name)
            result = process.wait_for(path, started + timeout)
            seconds = round(time.monotonic() - started, 1)
            if result is None:  # it timed out, or its process ended without its result
                code = process.poll()  # None: it runs on past the timeout
                process.stop()
                result = _read_json(path)  # written as the process was being stopped
                ended = "timed out" if code is None else _crash(code)
                if result is not None:
                    ended = "slow exit"
                self._record(section, result, ended, seconds, timeout, process.tail())
                return index + 1
            last = index == len(sections) - 1
            slow = last and not process.exits_by(started + timeout)
            ended = "slow exit" if slow else ""
            self._record(section, result, ended, seconds, timeout, process.tail())
            started = time.monotonic()
        return len(sections)

    def _running(self, section: Section, timeout: float) -> None:
        say(f"== {section.name} (at most {timeout:g} s): {section.shows}")
        record: dict[str, Any] = {"status": "running", "ok": False, "timeout_s": timeout}
        self.report["sections"][section.name] = record | self._shrunk(section, timeout)
        write_report(self.out, self.report)

    def _shrunk(self, section: Section, timeout: float) -> dict[str, Any]:
        planned = self.timeout_of(section)
        if timeout >= planned:
            return {}
        return {"note": f"timeout cut from {planned:g} s to {timeout:g} s by the run's deadline"}

    def _record(
        self,
        section: Section,
        result: dict[str, Any] | None,
        ended: str,
        seconds: float,
        timeout: float,
        tail: list[str],
    ) -> None:
        record = section_record(result, ended, seconds, timeout, tail)
        record |= self._shrunk(section, timeout)
        self.report["sections"][section.name] = record
        say(f"== {section.name}: {record['status']} in {record['seconds']} s")
        write_report(self.out, self.report)

    def _skip(self, section: Section) -> None:
        left = max(0.0, self.deadline.left())
        self.report["sections"][section.name] = {
            "status": "skipped (deadline)",
            "ok": False,
            "seconds": 0.0,
            "timeout_s": 0,
            "note": f"{left:.0f} s were left of the run's deadline, below {MIN_SECTION_S} s",
        }
        say(f"== {section.name}: skipped, {left:.0f} s left of the run's deadline")
        write_report(self.out, self.report)


def section_record(
    result: dict[str, Any] | None, ended: str, seconds: float, timeout: float, tail: list[str]
) -> dict[str, Any]:
    """A section's record: its status from its result, if it wrote one, else from how its
    process ended (`ended`: "timed out", "crashed (...)", or "slow exit" after a result)."""
    if result is None:
        status = ended
    elif "skipped" in result:
        status = "skipped"
    elif result.get("ok"):
        status = "passed (slow exit)" if ended == "slow exit" else "passed"
    else:
        status = "failed"
    record = {
        "status": status,
        "ok": status.startswith("passed") or status == "skipped",
        "seconds": seconds,
        "timeout_s": timeout,
        "result": result,
    }
    if not record["ok"]:
        record["tail"] = "\n".join(tail)
    return record


def _crash(code: int) -> str:
    if code < 0:
        return f"crashed (signal {-code})"
    return f"crashed (exit {code})"


class SectionProcess:
    """One process of sections, in a process group of its own, its output relayed as it
    comes and kept in OUT/logs/FIRST.log."""

    def __init__(self, command: list[str], out: Path, first: str) -> None:
        log = out / "logs" / f"{first}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        result_path(out, first).parent.mkdir(parents=True, exist_ok=True)
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self._relay = threading.Thread(
            target=_relay, args=(self.process.stdout, log, self._tail), daemon=True
        )
        self._relay.start()

    def wait_for(self, path: Path, until: float) -> dict[str, Any] | None:
        """The result at `path` once it is there; None if the process ends or `until`
        passes first."""
        while True:
            result = _read_json(path)
            if result is not None:
                return result
            if self.process.poll() is not None:
                return _read_json(path)  # written just before the process ended
            if time.monotonic() >= until:
                return None
            time.sleep(POLL_S)

    def exits_by(self, until: float) -> bool:
        try:
            self.process.wait(max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        """Kills the process and what it started and left behind (a server, compile workers)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._relay.join(5)

    def tail(self) -> list[str]:
        return list(self._tail)


def _relay(stream: IO[bytes], log: Path, tail: deque[str]) -> None:
    with log.open("wb") as kept:
        for line in iter(stream.readline, b""):
            kept.write(line)
            text = line.decode(errors="replace").rstrip("\n")
            tail.append(text)
            print(f"  {text}", flush=True)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- a section process ----------------------------------------------------------------------


def run_child(names: list[str], args: argparse.Namespace) -> int:
    """The process of `names`, in order, sharing one Context (and so its workers): each
    one's result, or its error, in result_path as it ends. 0 when every one passed."""
    from ops.device_sections import Context

    ctx = Context.of(args)
    started, codes = STARTED, []
    for name in names:
        section = next(section for section in SECTIONS if section.name == name)
        starts = ctx.worker_starts
        ctx.last_in_process = name == names[-1]
        try:
            run: Callable[[Context], dict[str, Any]]
            run = getattr(importlib.import_module(section.module), section.name)
            result = run(ctx)
        except Exception:  # the section's failure is its result
            result = {"ok": False, "error": traceback.format_exc()}
            print(result["error"], file=sys.stderr, flush=True)
        result["worker_starts"] = ctx.worker_starts - starts
        result["section_seconds"] = round(time.perf_counter() - started, 1)
        write_result(result_path(args.out_dir, name), result)
        codes.append(0 if result.get("ok") else 1)
        started = time.perf_counter()
    return max(codes, default=0)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Whole or not at all: the runner reads it while the process runs on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(partial, path)


def exit_now(code: int) -> None:
    """Ends a section process as soon as its results are written: Python's exit would wait
    for Inductor's compile workers and tear down a CUDA context holding a large cache."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    found.add_argument(
        "--deadline-s",
        type=float,
        default=DEADLINE_S,
        help="the whole run's seconds: later sections are cut short or skipped (default: 480)",
    )
    found.add_argument("--sections", nargs="+", choices=SECTION_NAMES, help=argparse.SUPPRESS)
    found.add_argument(
        "--requirements", action="store_true", help="print what --wheels must hold, and exit"
    )
    return found


def child_command(args: argparse.Namespace, sections: list[Section]) -> list[str]:
    """The command of the process of `sections`: this script, with the run's settings."""
    command = [sys.executable, "-m", "ops.device_check", str(args.out_dir), "--sections"]
    command += [section.name for section in sections]
    command += ["--device", args.device, "--kernels", args.kernels]
    command += ["--hbm-tbps", str(args.hbm_tbps), "--matmul-tflops", str(args.matmul_tflops)]
    command += ["--work", str(args.work)] + (["--quick"] if args.quick else [])
    return command + (["--wheels", str(args.wheels)] if args.wheels else [])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.requirements:
        from ops.device_wheels import service_requirements

        print("\n".join(service_requirements()))
        return 0
    if args.out_dir is None:
        parser().error("OUT_DIR is required")
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.work = args.work.resolve()
    if args.sections:
        exit_now(run_child(args.sections, args))
    chosen = [s for s in SECTIONS if args.only is None or s.name in args.only]
    report: dict[str, Any] = {"device": args.device, "quick": args.quick, "sections": {}}
    report["deadline_s"] = args.deadline_s
    if args.only:  # the other sections' results stay as the last run left them
        earlier = _read_json(args.out_dir / "report.json") or {}
        report["sections"] = earlier.get("sections", {})
    started = time.monotonic()
    report = run_sections(
        chosen,
        lambda sections: child_command(args, sections),
        args.out_dir,
        report,
        lambda section: QUICK_TIMEOUT_S if args.quick else section.timeout_s,
        Deadline.after(args.deadline_s),
    )
    report["seconds"] = round(time.monotonic() - started, 1)
    write_report(args.out_dir, report)
    say(f"report: {args.out_dir / 'report.md'}; passed: {report['passed']}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
