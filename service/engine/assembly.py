"""The one place an engine is assembled and run: model files, tokenizer, worker, engine.

    async with open_engine(config) as engine:
        channel = await engine.submit(prompt_ids, params, request_id="r1")

The server, the offline API, the engine benchmark and the tests all start engines here;
tests pass a simulated worker and tokenizer in place of the real ones.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from service.config import Config
from service.engine.engine import Engine
from service.engine.sequences import TokenizerLike
from service.engine.supervision import Worker
from service.engine.worker_link import WorkerLink, worker_config_for
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer


@asynccontextmanager
async def open_engine(
    config: Config,
    *,
    model_dir: Path | None = None,
    worker: Worker | None = None,
    tokenizer: TokenizerLike | None = None,
    wait_ready: bool = True,
) -> AsyncIterator[Engine]:
    """Run an engine for the duration of the block; leaving it shuts the engine down.

    With `wait_ready` the block starts once the worker has loaded; without it at once (a
    server answers 503 meanwhile), and a worker that cannot start ends the block with
    its error. `model_dir` defaults to `config.model` resolved through the model cache.
    """
    if worker is None or tokenizer is None:
        model_dir = model_dir or resolve_model(config.model, config.cache_dir)
        tokenizer = tokenizer or Tokenizer.from_dir(model_dir)
        worker = worker or WorkerLink(worker_config_for(config, model_dir))
    engine = Engine(config, worker, tokenizer)
    async with trio.open_nursery() as nursery:
        if wait_ready:
            await nursery.start(engine.run)
        else:
            nursery.start_soon(engine.run)
        yield engine
        nursery.cancel_scope.cancel()
