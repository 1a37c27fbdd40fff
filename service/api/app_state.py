"""What every route needs from the running server, kept on the Quart app."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from quart import current_app

if TYPE_CHECKING:
    from service.api.metrics import Metrics
    from service.config import Config
    from service.engine.adapters import AdapterRegistry
    from service.engine.engine import Engine
    from service.engine.grammar import GrammarCompiler
    from service.tokenizer import Tokenizer

EXTENSION_KEY = "cadence"
TOKENIZER_THREADS = 2  # prompts tokenized at once, off the event loop
# grammars compiled at once: their own threads, so a slow schema never holds up the
# tokenizing of requests without one
GRAMMAR_THREADS = 1


@dataclass(slots=True)
class AppState:
    config: Config
    engine: Engine
    tokenizer: Tokenizer
    served_model_name: str
    metrics: Metrics
    heartbeat_seconds: float = 1.0
    tokenizer_threads: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(TOKENIZER_THREADS)
    )
    grammar_threads: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(GRAMMAR_THREADS)
    )
    grammars: GrammarCompiler | None = None  # None: no structured output (response_format)
    adapters: AdapterRegistry | None = None  # None: no LoRA (--enable-lora not given)


def app_state() -> AppState:
    return current_app.extensions[EXTENSION_KEY]
