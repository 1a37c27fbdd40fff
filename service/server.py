"""Serve a cadence engine over HTTP on Hypercorn, until a signal or until the engine fails."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer
from quart_trio import QuartTrio

from service.api.app import create_app
from service.config import Config
from service.engine.assembly import open_engine
from service.engine.engine import Engine
from service.logging import configure_logging
from service.model_files.resolve import print_progress, resolve_model, served_model_name
from service.tokenizer import Tokenizer

CLOSE_GRACE_SECONDS = 2.0  # after the drain: for the last events to reach the clients
log = structlog.get_logger("cadence.server")


def survive_the_send_race() -> None:
    """Hypercorn 0.18's trio TCPServer closes a connection (send_eof) without holding the
    lock its sends hold, so a send that starts during the close raises BusyResourceError,
    which nothing catches: it ended the whole server. sglang-router's HTTP/2 health probe
    did it to about one replica start in four. The send is to a connection being closed:
    treat it like the BrokenResourceError hypercorn catches there, as the peer gone."""
    send = TCPServer.protocol_send
    if hasattr(send, "__wrapped__"):
        return  # done already

    @functools.wraps(send)
    async def protocol_send(self: TCPServer, event: Event) -> None:
        try:
            await send(self, event)
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())

    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]


@dataclass(slots=True)
class Server:
    config: Config
    model_dir: Path
    tokenizer: Tokenizer
    served_model_name: str

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
                app = create_app(self.config, engine, self.tokenizer, self.served_model_name)
                await self._serve_http(app, engine)
            failed = engine.failure is not None
        except* Exception as failure:
            log.error("engine.failed", error=repr(failure.exceptions[0]))
            failed = True
        log.info("server.stopped", engine_failed=failed)
        return 1 if failed else 0

    async def _serve_http(self, app: QuartTrio, engine: Engine) -> None:
        survive_the_send_race()
        async with trio.open_nursery() as nursery:

            async def serve_until_shut_down(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve(
                    app,
                    self.hypercorn_config(),
                    shutdown_trigger=lambda: self._shut_down_on_signal(engine, nursery),
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()  # ends the connection cutter, if it still waits

            binds = await nursery.start(serve_until_shut_down)
            url = binds[0] if binds else f"http://{self.config.host}:{self.config.port}"
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


def build_server(config: Config) -> Server:
    """Everything up to serving; raises ModelFileError for a model that cannot be served."""
    configure_logging(
        config.log_file,
        config.log_level,
        max_bytes=config.log_max_bytes,
        backups=config.log_backups,
    )
    model_dir = resolve_model(config.model, config.cache_dir, progress=print_progress)
    name = config.served_model_name or served_model_name(config.model)
    return Server(config, model_dir, Tokenizer.from_dir(model_dir), name)
