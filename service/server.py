"""Assemble a cadence server (model, tokenizer, worker, engine, app) and serve it on Hypercorn."""

from __future__ import annotations

import signal
from dataclasses import dataclass

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart_trio import QuartTrio

from service.api.app import ENGINE_FAILED_KEY, create_app
from service.config import Config
from service.engine.engine import Engine
from service.engine.worker_link import WorkerLink, worker_config_for
from service.logging import configure_logging
from service.model_files.resolve import print_progress, resolve_model, served_model_name
from service.tokenizer import Tokenizer

DRAIN_SECONDS = 5.0
log = structlog.get_logger("cadence.server")


@dataclass(slots=True)
class Server:
    config: Config
    engine: Engine
    app: QuartTrio

    async def serve(self) -> int:
        """Serve until SIGINT/SIGTERM (exit 0) or until the engine fails (exit 1)."""
        failed: trio.Event = self.app.extensions[ENGINE_FAILED_KEY]
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: serve(
                    self.app,
                    self.hypercorn_config(),
                    shutdown_trigger=self.stop_requested,
                    task_status=task_status,
                )
            )
            url = binds[0] if binds else f"http://{self.config.host}:{self.config.port}"
            print(f"cadence listening on {url}", flush=True)
            log.info("server.listening", url=url)
        log.info("server.stopped", engine_failed=failed.is_set())
        return 1 if failed.is_set() else 0

    def hypercorn_config(self) -> HypercornConfig:
        hc = HypercornConfig()
        host = self.config.host
        hc.bind = [f"[{host}]:{self.config.port}" if ":" in host else f"{host}:{self.config.port}"]
        hc.accesslog = None  # the engine logs every request as JSON already
        hc.errorlog = "-"
        hc.loglevel = "WARNING"
        hc.graceful_timeout = DRAIN_SECONDS
        return hc

    async def stop_requested(self) -> None:
        """Hypercorn's shutdown trigger: returns once in-flight requests are drained."""
        failed: trio.Event = self.app.extensions[ENGINE_FAILED_KEY]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_wait_for_signal, nursery.cancel_scope)
            nursery.start_soon(_wait_for_event, failed, nursery.cancel_scope)
        log.info("server.shutdown", drain_seconds=DRAIN_SECONDS)
        if not failed.is_set():
            # Stop admitting, let running requests finish, abort the rest with "shutdown"
            # so their streams end with a reason before the connections close.
            self.engine.begin_shutdown()
            await self.engine.drain(DRAIN_SECONDS)


async def _wait_for_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("server.signal", signal=signal.Signals(signum).name)
            break
    scope.cancel()


async def _wait_for_event(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def build_server(config: Config) -> Server:
    """Everything up to serving; raises ModelFileError for a model that cannot be served."""
    configure_logging(config.log_file, config.log_level)
    model_dir = resolve_model(config.model, config.cache_dir, progress=print_progress)
    tokenizer = Tokenizer.from_dir(model_dir)
    engine = Engine(config, WorkerLink(worker_config_for(config, model_dir)), tokenizer)
    name = config.served_model_name or served_model_name(config.model)
    return Server(config, engine, create_app(config, engine, tokenizer, name))
