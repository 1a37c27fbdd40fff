"""`cadence pd`: disaggregated prefill and decode on one machine, as one command.

    cadence pd [--host 127.0.0.1] [--port 8000] [--prefill-port 0] [--decode-port 0]
        [--producer-arg ARG ...] [--consumer-arg ARG ...] [--router-arg ARG ...]
        [--log-dir DIR] [--startup-timeout 600] [--stop-timeout 15] [-- SERVE FLAGS]

It runs the README's three commands (Prefill and decode on two servers):

    cadence serve --port P --kv-transfer-role producer SERVE FLAGS PRODUCER ARGS
    cadence serve --port D --kv-transfer-role consumer SERVE FLAGS CONSUMER ARGS
    vllm-router --port 8000 --vllm-pd-disaggregation --prefill URL_P --decode URL_D

The flags after `--` go to both servers (model, dtype, --kv-memory...), --producer-arg and
--consumer-arg to one (`--consumer-arg=--max-num-seqs=64`), --router-arg to vllm-router.
The servers load side by side; once both answer /health the router starts, and the command
prints each one's URL, then the router's. One trio nursery owns the three processes: Ctrl-C
or SIGTERM stops them all (SIGTERM to each, a server drains its running requests; SIGKILL
after --stop-timeout s), and so does any one of them exiting on its own, since a pair
without its producer, its consumer or its router serves nobody. The exit code is 0 after a
signal, else that of the first process to exit (128 + N for a signal N).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import httpx
import trio

PROG = "cadence pd"
LISTENING = b"cadence listening on "  # the line `cadence serve` prints on stdout
ROLE_FLAG = "--kv-transfer-role"


class LaunchError(RuntimeError):
    """A process that would not start; every one started so far is stopped."""


@dataclass(slots=True)
class Child:
    name: str
    process: trio.Process
    url: str = ""


@dataclass(slots=True)
class FirstExit:
    """The first child to exit without being asked to: it ends the others."""

    name: str = ""
    returncode: int | None = None

    @property
    def exit_code(self) -> int:
        """This command's: 0 when nothing exited on its own (a signal stopped them)."""
        code = self.returncode or 0
        return 128 - code if code < 0 else code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1", help="for the servers and the router")
    parser.add_argument("--port", type=int, default=8000, help="the router's (0: a free one)")
    parser.add_argument("--router-metrics-port", type=int, default=0, help="0: a free one")
    parser.add_argument("--prefill-port", type=int, default=0, help="the producer's (0: free)")
    parser.add_argument("--decode-port", type=int, default=0, help="the consumer's (0: free)")
    for side in ("producer", "consumer", "router"):
        parser.add_argument(
            f"--{side}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"repeatable, given to the {side} as is: --{side}-arg=--log-level=debug",
        )
    parser.add_argument("--log-dir", type=Path, default=None, help="a log file per process")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--stop-timeout", type=float, default=15.0, help="seconds")
    return parser


def serve_command(host: str, port: int, role: str, serve_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "service.cli", "serve", "--host", host, "--port", str(port),
            ROLE_FLAG, role, *serve_args]  # fmt: skip


def router_command(
    router: str, args: argparse.Namespace, port: int, producer: str, consumer: str
) -> list[str]:
    metrics_port = args.router_metrics_port or free_port(args.host)
    return [
        router, "--host", args.host, "--port", str(port),
        "--prometheus-host", args.host, "--prometheus-port", str(metrics_port),
        "--vllm-pd-disaggregation", "--prefill", producer, "--decode", consumer,
        *args.router_arg,
    ]  # fmt: skip


def find_router() -> str | None:
    """vllm-router beside this interpreter (the pd extra installs it there), or on the PATH."""
    beside = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    return beside or shutil.which("vllm-router")


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def stop_gently(process: trio.Process, timeout: float) -> None:
    """run_process's deliver_cancel: SIGTERM, then SIGKILL after `timeout` seconds."""
    process.terminate()
    with trio.move_on_after(timeout):
        await process.wait()
    if process.returncode is None:
        process.kill()


async def start_child(
    nursery: trio.Nursery, name: str, command: list[str], stdout: object, stderr: object,
    stop_timeout: float, first_exit: FirstExit,
) -> Child:  # fmt: skip
    """Run `command` as a task of `nursery` (cancelling it stops the child). A child that
    exits before being asked to is reported and cancels the nursery: the others stop."""

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
        await process.wait()  # cancelled when we stop it: then not reported
        print(f"{PROG}: {name} exited with {process.returncode}", file=sys.stderr, flush=True)
        if first_exit.returncode is None:
            first_exit.name, first_exit.returncode = name, process.returncode
        nursery.cancel_scope.cancel()

    return await nursery.start(supervise)


async def read_url(child: Child, nursery: trio.Nursery, timeout: float) -> str:
    """The URL `cadence serve` prints on stdout once it listens; the rest is drained."""
    stdout = child.process.stdout
    assert stdout is not None
    buffered = b""
    with trio.move_on_after(timeout):
        while not (LISTENING in buffered and buffered.endswith(b"\n")):
            chunk = await stdout.receive_some()
            if not chunk:
                raise LaunchError(f"{child.name} exited before listening")
            buffered += chunk
        nursery.start_soon(drain, stdout)
        line = buffered[buffered.index(LISTENING) :].split(b"\n", 1)[0]
        url = line.removeprefix(LISTENING).decode().strip()
        return url.replace("//0.0.0.0:", "//127.0.0.1:")  # where the router can reach it
    raise LaunchError(f"{child.name} not listening after {timeout} s")


async def drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some():
        pass


async def wait_ready(child: Child, url: str, timeout: float) -> None:
    """Poll `url` until it answers 200; fail at once if the child exits."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        with trio.move_on_after(timeout):
            while child.process.returncode is None:
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.2)
            raise LaunchError(f"{child.name} exited with {child.process.returncode}")
    raise LaunchError(f"{child.name} not ready at {url} after {timeout} s")


def open_log(log_dir: Path | None, name: str) -> IO[bytes] | None:
    if log_dir is None:
        return None  # the terminal's
    log_dir.mkdir(parents=True, exist_ok=True)
    return open(log_dir / f"{name}.log", "ab")  # lives as long as the child


async def start_servers(
    nursery: trio.Nursery, args: argparse.Namespace, serve_args: list[str], first_exit: FirstExit
) -> tuple[Child, Child]:
    """The producer and the consumer, loading side by side, once both answer /health."""
    sides = [
        ("producer", args.prefill_port, args.producer_arg),
        ("consumer", args.decode_port, args.consumer_arg),
    ]
    children = []
    for role, port, own_args in sides:
        command = serve_command(args.host, port, role, [*serve_args, *own_args])
        log = open_log(args.log_dir, role)
        children.append(
            await start_child(
                nursery, role, command, subprocess.PIPE, log, args.stop_timeout, first_exit
            )
        )
    for child in children:
        child.url = await read_url(child, nursery, args.startup_timeout)
    for child in children:
        await wait_ready(child, f"{child.url}/health", args.startup_timeout)
    return children[0], children[1]


async def start_router(
    nursery: trio.Nursery, args: argparse.Namespace, router: str, servers: tuple[Child, Child],
    first_exit: FirstExit,
) -> Child:  # fmt: skip
    port = args.port or free_port(args.host)  # chosen late: the servers have theirs
    command = router_command(router, args, port, servers[0].url, servers[1].url)
    log = open_log(args.log_dir, "router")
    child = await start_child(nursery, "router", command, log, log, args.stop_timeout, first_exit)
    child.url = f"http://{args.host}:{port}"
    # the models list goes through the router to a server: the whole path answers
    await wait_ready(child, f"{child.url}/v1/models", args.startup_timeout)
    return child


async def run(args: argparse.Namespace, router: str, serve_args: list[str]) -> int:
    first_exit, failed_to_start = FirstExit(), False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_on_signal, nursery.cancel_scope)
            servers = await start_servers(nursery, args, serve_args, first_exit)
            child = await start_router(nursery, args, router, servers, first_exit)
            for each in (*servers, child):
                print(f"{each.name}: {each.url} (pid {each.process.pid})")
            print(f"{PROG}: ready at {child.url}; Ctrl-C stops all three", flush=True)
            await trio.sleep_forever()  # until a signal or a child's exit cancels the nursery
    except* LaunchError as group:
        for exc in group.exceptions:
            print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        failed_to_start = True
    return first_exit.exit_code or int(failed_to_start)


async def stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"{PROG}: {signal.Signals(signum).name}, stopping", file=sys.stderr, flush=True)
            scope.cancel()
            return


def main(argv: list[str]) -> int:
    ours, serve_args = split_at_dashes(argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    given = [*serve_args, *args.producer_arg, *args.consumer_arg]
    if any(arg.startswith(ROLE_FLAG) for arg in given):
        parser.error(f"{ROLE_FLAG} is the command's to give: producer to one, consumer to one")
    router = find_router()
    if router is None:
        parser.error("vllm-router is missing: pip install 'cadence[pd]'")
    return trio.run(run, args, router, serve_args)


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our flags before `--`, cadence serve's after it."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []
