"""Serve a cadence engine over HTTP on Hypercorn, until a signal or until the engine fails."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import resource
import signal
import socket
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer
from quart_trio import QuartTrio

from service.api.app import create_app
from service.config import Config
from service.connections import Connections
from service.engine.adapters import AdapterRegistry, registry_at_start
from service.engine.assembly import open_engine
from service.engine.engine import Engine
from service.logging import configure_logging
from service.model_files.resolve import print_progress, resolve_model, served_model_name
from service.tokenizer import Tokenizer

CLOSE_GRACE_SECONDS = 2.0  # after the drain: for the last events to reach the clients
# descriptors beside the connections: the listener, logs, the worker's channel and its
# restart's socketpair, model files, tokenizer threads
DESCRIPTOR_RESERVE = 64
log = structlog.get_logger("cadence.server")


def contain_connection_failures(max_connections: int | None = None) -> None:
    """One HTTP connection's failure ends that connection, never the server.

    Hypercorn 0.18 runs each connection as a task of the server's own nursery, so an error
    it does not expect in one connection's handling ended the whole server. sglang-router's
    HTTP/2 health probe found two, at about one replica start in four: a send that starts
    while the connection is closing (trio.BusyResourceError: `TCPServer._close` sends its
    EOF without the lock the sends hold) and a KeyError for an HTTP/2 stream the closing
    connection had dropped. The connection's own cleanup (its `finally`) has run by then;
    the failure is logged and the server goes on. Cancellation still propagates.
    The same wrapper keeps the open connections within the cap (service.connections)."""
    Connections.limit = max_connections
    run = TCPServer.run
    if hasattr(run, "__wrapped__"):
        return  # done already
    TCPServer.run = contained(run)  # type: ignore[method-assign,assignment]


def contained(
    run: Callable[[TCPServer], Awaitable[None]],
) -> Callable[[TCPServer], Awaitable[None]]:
    @functools.wraps(run)
    async def run_one_connection(self: TCPServer) -> None:
        connection = await Connections.admit(self)
        if connection is None:
            return
        try:
            await run(self)
        except Exception as failure:  # one connection's: see contain_connection_failures
            log.warning("http.connection_failed", error=repr(failure))
        finally:
            Connections.forget(connection)

    return run_one_connection


@dataclass(slots=True)
class Server:
    config: Config
    model_dir: Path
    tokenizer: Tokenizer
    served_model_name: str
    adapters: AdapterRegistry | None = None  # --enable-lora's

    async def serve(self) -> int:
        """Serve until SIGINT/SIGTERM (exit 0) or until the engine fails (exit 1).

        HTTP answers at once (/health is 503 while the worker loads); a worker that
        cannot start ends the engine, and with it the server.
        """
        failed = False
        try:
            async with open_engine(
                self.config, model_dir=self.model_dir, tokenizer=self.tokenizer, wait_ready=False
            ) as engine:
                app = create_app(
                    self.config, engine, self.tokenizer, self.served_model_name, self.adapters
                )
                await self._serve_http(app, engine)
            failed = engine.failure is not None
        except* Exception as failure:
            log.error("engine.failed", error=repr(failure.exceptions[0]))
            failed = True
        log.info("server.stopped", engine_failed=failed)
        return 1 if failed else 0

    async def _serve_http(self, app: QuartTrio, engine: Engine) -> None:
        contain_connection_failures(self.config.max_connections)
        async with trio.open_nursery() as nursery:

            async def serve_until_shut_down(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve(
                    app,
                    self.hypercorn_config(),
                    shutdown_trigger=lambda: self._shut_down_on_signal(engine, nursery),
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()  # ends the sweeper and the connection cutter

            # a second past the 408, so that the answer is out before the connection closes
            stalled_after = self.config.body_timeout + 1.0
            nursery.start_soon(Connections.close_stalled_bodies, stalled_after)
            binds = await nursery.start(serve_until_shut_down)
            url = binds[0] if binds else f"http://{self.config.host}:{self.config.port}"
            # the start's heap (app, tokenizer, engine) out of the collector's reach, as
            # vLLM's server does: a full collection under a flood of connections then walks
            # what the flood made, not everything, and a stream's gap stays short
            gc.freeze()
            print(f"cadence listening on {url}", flush=True)
            log.info("server.listening", url=url)

    def hypercorn_config(self) -> HypercornConfig:
        hc = HypercornConfig()
        host = self.config.host
        hc.bind = [f"[{host}]:{self.config.port}" if ":" in host else f"{host}:{self.config.port}"]
        hc.accesslog = None  # the engine logs every request as JSON already
        hc.errorlog = "-"
        hc.loglevel = "WARNING"
        hc.graceful_timeout = CLOSE_GRACE_SECONDS
        # Hypercorn's idle timer runs from a connection's start, and from the end of each
        # answer, until a whole request head has arrived: the head's timeout
        hc.keep_alive_timeout = self.config.head_timeout
        # a burst of connections waits in the kernel's queue for accept, not in SYN retries
        hc.backlog = self.config.max_connections
        return hc

    async def _shut_down_on_signal(self, engine: Engine, nursery: trio.Nursery) -> None:
        """Hypercorn's shutdown trigger, on a signal or when the engine stopped on its own
        (its worker cannot be restarted): returns once in-flight requests are drained."""
        async with trio.open_nursery() as waiters:
            waiters.start_soon(_wait_for_signal, waiters.cancel_scope)
            waiters.start_soon(_wait_for_engine_stop, engine, waiters.cancel_scope)
        timeout = self.config.shutdown_timeout
        log.info("server.shutdown", drain_seconds=timeout)
        # Stop admitting, let running requests finish, abort the rest with "shutdown" so
        # their streams end with a reason before the connections close.
        engine.begin_shutdown()
        await engine.drain(timeout)
        nursery.start_soon(_cut_connections_after, CLOSE_GRACE_SECONDS + 0.5)


async def _wait_for_signal(done: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("server.signal", signal=signal.Signals(signum).name)
            break
    done.cancel()


async def _wait_for_engine_stop(engine: Engine, done: trio.CancelScope) -> None:
    await engine.wait_stopped()
    done.cancel()


async def _cut_connections_after(seconds: float) -> None:
    """Hypercorn writes to a client inside a shielded cancel scope, so a client that never
    reads would keep the server alive for ever after its graceful timeout. Shutting those
    sockets down makes the blocked write fail, and the server can end."""
    await trio.sleep(seconds)
    cut = 0
    for fd in _client_connection_fds():
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            with sock:
                sock.shutdown(socket.SHUT_RDWR)
            cut += 1
    log.warning("server.connections_cut", count=cut)


def _client_connection_fds() -> list[int]:
    """This process's connected TCP sockets (the clients'; the worker's channel is a Unix
    socket and the listener has no peer)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with probe:
            if probe.family in (socket.AF_INET, socket.AF_INET6) and _has_peer(probe):
                fds.append(fd)
    return fds


def _has_peer(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


def raise_descriptor_limit() -> int:
    """Take the hard limit of open files, and return the limit now in force: each
    connection holds one, and a worker restart needs a socketpair, which must not fail
    because clients took the last descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def report_descriptor_limit(limit: int, max_connections: int) -> None:
    """Log the limit, and warn when the connection cap leaves the server too few beside it."""
    log.info("server.descriptor_limit", open_files=limit, max_connections=max_connections)
    if limit != resource.RLIM_INFINITY and max_connections + DESCRIPTOR_RESERVE > limit:
        log.warning(
            "server.descriptor_limit_low",
            open_files=limit,
            max_connections=max_connections,
            reserve=DESCRIPTOR_RESERVE,
            hint="lower --max-connections or raise the hard limit (ulimit -Hn)",
        )


def build_server(config: Config) -> Server:
    """Everything up to serving; raises ModelFileError for a model that cannot be served."""
    limit = raise_descriptor_limit()
    configure_logging(
        config.log_file,
        config.log_level,
        max_bytes=config.log_max_bytes,
        backups=config.log_backups,
    )
    report_descriptor_limit(limit, config.max_connections)
    model_dir = resolve_model(config.model, config.cache_dir, progress=print_progress)
    name = config.served_model_name or served_model_name(config.model)
    tokenizer = Tokenizer.from_dir(model_dir, config.chat_template)
    adapters = None
    if config.enable_lora:  # raises AdapterError for a --lora-modules that does not fit
        adapters = registry_at_start(model_dir, config.max_lora_rank, config.lora_modules)
    return Server(config, model_dir, tokenizer, name, adapters)
