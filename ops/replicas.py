"""`cadence replicas`: N cadence servers behind sglang-router, started and stopped as one.

    cadence replicas [-n 2] [--host 127.0.0.1] [--port 8001] [--router-port 8000]
        [--router-metrics-port 29000] [--policy cache_aware] [--router-arg ARG ...]
        [--log-dir DIR] [-- SERVE FLAGS]

Starts `cadence serve` N times on consecutive ports from --port (0: each picks a free one),
passing it the flags after `--` (e.g. `-- --kv-memory 2e9 --policy stall_free`), waits for
each one's /health, then starts sglang-router (`pip install 'cadence[router]'`) in front of
them with --policy, and prints the router's URL and each replica's. Ctrl-C or SIGTERM stops
them all: each child gets SIGTERM (a cadence replica drains its running requests) and
SIGKILL if it has not exited --stop-timeout seconds later. One trio nursery owns every
child process, so none outlives the command, however it ends (short of SIGKILL).

A replica that dies is reported and left dead: the router stops sending it requests once
its health checks fail, and the others carry on. The router exiting ends the command.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import trio

from service.pd_launch import (  # child-process helpers shared with `cadence pd`
    Child,
    LaunchError,
    open_log,
    read_url,
    split_at_dashes,
    stop_gently,
    wait_ready,
)

PROG = "cadence replicas"
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--replicas", type=int, default=2, help="cadence servers")
    parser.add_argument("--host", default="127.0.0.1", help="for the replicas and the router")
    parser.add_argument("--port", type=int, default=8001, help="the first replica's (0: free)")
    parser.add_argument("--router-port", type=int, default=8000)
    parser.add_argument("--router-metrics-port", type=int, default=29000, help="its Prometheus")
    parser.add_argument("--policy", default="cache_aware", choices=POLICIES, help="the router's")
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="repeatable, given to sglang-router as is: --router-arg=--retry-max-retries=3",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="a log file per child")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--stop-timeout", type=float, default=15.0, help="seconds")
    return parser


def serve_command(host: str, port: int, serve_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "service.cli", "serve",
            "--host", host, "--port", str(port), *serve_args]  # fmt: skip


def router_command(args: argparse.Namespace, worker_urls: Sequence[str]) -> list[str]:
    """sglang-router's own launcher, as `python -m` (its console script may not be on PATH)."""
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", args.host, "--port", str(args.router_port), "--policy", args.policy,
        "--prometheus-host", args.host, "--prometheus-port", str(args.router_metrics_port),
        "--worker-urls", *worker_urls,
        *args.router_arg,
    ]  # fmt: skip


async def start_child(
    nursery: trio.Nursery, name: str, command: list[str], stdout: object, stderr: object,
    stop_timeout: float,
) -> Child:  # fmt: skip
    """Run `command` as a task of `nursery` (cancelling it stops the child); an exit we did
    not ask for is reported."""

    async def supervise(task_status: trio.TaskStatus[Child]) -> None:
        process = await nursery.start(
            partial(
                trio.run_process,
                command,
                check=False,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop them
                deliver_cancel=partial(stop_gently, timeout=stop_timeout),
            )
        )
        task_status.started(Child(name, process))
        await process.wait()
        print(f"{PROG}: {name} exited with {process.returncode}", file=sys.stderr, flush=True)

    return await nursery.start(supervise)


async def start_replicas(
    nursery: trio.Nursery, args: argparse.Namespace, serve_args: list[str]
) -> list[Child]:
    replicas = []
    for i in range(args.replicas):
        command = serve_command(args.host, args.port + i if args.port else 0, serve_args)
        log = open_log(args.log_dir, f"replica-{i}")
        child = await start_child(
            nursery, f"replica-{i}", command, subprocess.PIPE, log, args.stop_timeout
        )
        replicas.append(child)
    for child in replicas:  # they load the model side by side
        child.url = await read_url(child, nursery, args.startup_timeout)
    for child in replicas:
        await wait_ready(child, f"{child.url}/health", args.startup_timeout)
    return replicas


async def start_router(
    nursery: trio.Nursery, args: argparse.Namespace, replicas: list[Child]
) -> Child:
    command = router_command(args, [child.url for child in replicas])
    log = open_log(args.log_dir, "router")
    router = await start_child(nursery, "router", command, log, log, args.stop_timeout)
    router.url = f"http://{args.host}:{args.router_port}"
    await wait_ready(router, f"{router.url}/readiness", args.startup_timeout)
    return router


async def run(args: argparse.Namespace, serve_args: list[str]) -> int:
    """0 when stopped by a signal; 1 when the router ended on its own."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signal, nursery.cancel_scope)
        replicas = await start_replicas(nursery, args, serve_args)
        router = await start_router(nursery, args, replicas)
        print(f"router: {router.url} (policy {args.policy}, pid {router.process.pid})")
        for child in replicas:
            print(f"{child.name}: {child.url} (pid {child.process.pid})")
        print(f"{PROG}: ready; Ctrl-C stops them all", flush=True)
        await router.process.wait()
        nursery.cancel_scope.cancel()
        return 1
    return 0


async def stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"{PROG}: {signal.Signals(signum).name}, stopping", file=sys.stderr, flush=True)
            scope.cancel()
            return


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, serve_args = split_at_dashes(argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    try:
        return trio.run(run, args, serve_args)
    except* LaunchError as group:  # a child that would not start
        for exc in group.exceptions:
            print(f"{PROG}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
