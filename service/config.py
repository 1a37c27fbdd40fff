"""The one configuration object of a cadence server (CLI flags map onto it 1:1)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """Where converted models live: $CADENCE_CACHE, $XDG_CACHE_HOME/cadence or ~/.cache/cadence."""
    explicit = os.environ.get("CADENCE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cadence"


@dataclass(slots=True)
class Config:
    # model and worker
    model: str | None = None  # HF directory or .gguf file; None: the default SmolLM2-135M-Instruct
    dtype: str = "bfloat16"
    device: str = "auto"
    kv_memory: float = 0.25  # <= 1.0: fraction of free device memory; > 1.0: bytes
    block_size: int = 16
    cache_dir: Path = field(default_factory=default_cache_dir)
    use_cuda_graphs: bool = True
    seed: int = 0
    # scheduling
    policy: str = "stall_free"
    policy_params: dict[str, Any] = field(default_factory=dict)
    max_batched_tokens: int = 512  # hard cap of tokens in one step, whatever the policy says
    max_num_seqs: int = 128
    max_queue: int = 1024  # waiting requests beyond this get "overloaded" (HTTP 429)
    watermark: float = 0.01  # fraction of KV blocks kept free when admitting
    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    served_model_name: str | None = None  # None: derived from the model path
    # logging
    log_file: Path | None = None  # None: JSON lines on stderr
    log_level: str = "info"
    debug_invariants: bool = False  # check block accounting every iteration
