"""Serve a cadence engine over HTTP on Hypercorn, until a signal or until the engine fails."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart_trio import QuartTrio

from service.api.app import create_app
from service.config import Config
from service.engine.assembly import open_engine
from service.engine.engine import Engine
from service.logging import configure_logging
from service.model_files.resolve import print_progress, resolve_model, served_model_name
from service.tokenizer import Tokenizer

DRAIN_SECONDS = 5.0
log = structlog.get_logger("cadence.server")


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
        except* Exception as failure:
            log.error("engine.failed", error=repr(failure.exceptions[0]))
            failed = True
        log.info("server.stopped", engine_failed=failed)
        return 1 if failed else 0

    async def _serve_http(self, app: QuartTrio, engine: Engine) -> None:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: serve(
                    app,
                    self.hypercorn_config(),
                    shutdown_trigger=lambda: _drain_on_signal(engine),
                    task_status=task_status,
                )
            )
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
        hc.graceful_timeout = DRAIN_SECONDS
        return hc


async def _drain_on_signal(engine: Engine) -> None:
    """Hypercorn's shutdown trigger: returns once in-flight requests are drained."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("server.signal", signal=signal.Signals(signum).name)
            break
    log.info("server.shutdown", drain_seconds=DRAIN_SECONDS)
    # Stop admitting, let running requests finish, abort the rest with "shutdown" so
    # their streams end with a reason before the connections close.
    engine.begin_shutdown()
    await engine.drain(DRAIN_SECONDS)


def build_server(config: Config) -> Server:
    """Everything up to serving; raises ModelFileError for a model that cannot be served."""
    configure_logging(config.log_file, config.log_level)
    model_dir = resolve_model(config.model, config.cache_dir, progress=print_progress)
    name = config.served_model_name or served_model_name(config.model)
    return Server(config, model_dir, Tokenizer.from_dir(model_dir), name)
