"""A server's tracing from start to end: the provider made when the app is built, the
engine's spans observer added, and the export queue flushed at shutdown, off the loop and
for a bounded time (a hanging collector must not hold the shutdown up)."""

from __future__ import annotations

from collections.abc import Callable

import trio
from quart_trio import QuartTrio

from service.config import Config
from service.engine.engine import Engine
from service.tracing.export import open_provider
from service.tracing.spans import RequestSpans

SERVICE_NAME = "cadence"
SHUTDOWN_SECONDS = 2.0  # to send the last spans at shutdown; what is left then is lost


def start_tracing(
    app: QuartTrio, config: Config, engine: Engine, dropped: Callable[[int], None], model: str
) -> None:
    assert config.otlp_traces_endpoint is not None
    provider = open_provider(
        config.otlp_traces_endpoint, config.otlp_traces_protocol, SERVICE_NAME, dropped
    )
    tracer = provider.get_tracer("cadence.engine")
    engine.add_observer(RequestSpans(tracer, model, config.otlp_trace_steps))

    @app.after_serving
    async def flush_spans() -> None:
        # the export thread may be waiting for a collector that never answers: give up on
        # it after a while (it is a daemon thread, gone when the process exits)
        with trio.move_on_after(SHUTDOWN_SECONDS):
            await trio.to_thread.run_sync(provider.shutdown, abandon_on_cancel=True)
