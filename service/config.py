"""The one configuration object of a cadence server (CLI flags map onto it 1:1)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_worker.protocol import WorkerConfig

_WORKER = WorkerConfig(model_dir="")  # the worker's defaults, the server's too


def default_cache_dir() -> Path:
    """Where converted models live: $CADENCE_CACHE, $XDG_CACHE_HOME/cadence or ~/.cache/cadence."""
    explicit = os.environ.get("CADENCE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cadence"


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client credential of the inference API and who its holder is."""

    key: str = field(repr=False)  # never in a log line or a traceback
    tenant: str  # the tenant every request made with this key belongs to
    may_set_priority: bool = False  # a client `priority` is honoured only from such keys
    # /metrics shows every tenant's counters (prefix-cache hits among them): only such keys
    # (and the admin token) may read it
    may_read_metrics: bool = False


@dataclass(slots=True)
class Config:
    # model and worker
    model: str | None = None  # HF directory or .gguf file; None: the default SmolLM2-135M-Instruct
    dtype: str = _WORKER.dtype
    device: str = _WORKER.device
    kv_memory: float = _WORKER.kv_memory  # <= 1.0: fraction of free device memory; > 1.0: bytes
    kv_cache_dtype: str = _WORKER.kv_cache_dtype  # "auto" (the model's dtype), "int8" or "fp8"
    block_size: int = _WORKER.block_size
    cache_dir: Path = field(default_factory=default_cache_dir)
    use_cuda_graphs: bool = _WORKER.use_cuda_graphs
    kernels: str = _WORKER.kernels  # measure each seam's candidates, or pin: "attention=torch"
    seed: int = _WORKER.seed
    # supervision of the worker
    step_timeout: float = 30.0  # a step (or an idle ping) slower than this means a hung worker
    max_worker_restarts: int = 5  # failed starts in a row before the server gives up (exit 1)
    # scheduling
    policy: str = "stall_free"
    policy_params: dict[str, Any] = field(default_factory=dict)
    # hard cap of tokens in one step, whatever the policy says
    max_batched_tokens: int = _WORKER.max_num_batched_tokens
    max_num_seqs: int = _WORKER.max_num_seqs
    max_queue: int = 1024  # waiting requests beyond this get "overloaded" (HTTP 429)
    # prompt tokens waiting to start beyond this get "overloaded" (at least one full prompt)
    max_queued_tokens: int = 262144
    # the share of the queue (sequences, prompt tokens) and of the KV blocks one tenant may
    # take (n x (prompt + max_tokens) counted); None: 0.5 with API keys, else no quota
    tenant_quota: float | None = None
    max_queue_time: float | None = None  # seconds a request may wait to start, else 429
    # refuse at arrival (429) a request whose predicted TTFT exceeds this many seconds
    max_predicted_ttft: float | None = None
    max_model_len: int | None = None  # None: the model's own context window
    watermark: float = 0.01  # fraction of KV blocks kept free when admitting
    # after a preemption, admission waits until this fraction of the blocks is free again
    admission_watermark: float = 0.05
    max_preemptions: int = 3  # a request preempted this many times is never a victim again
    # requests sharing a prefix share its KV blocks (hash-chained full blocks, LRU-evicted)
    enable_prefix_caching: bool = True
    # "tenant": cached prefixes are shared only within a tenant; "none": by everyone;
    # None: "tenant" when API keys are set (their tenants are known), else "none"
    cache_isolation: str | None = None
    # usage.prompt_tokens_details (cached_tokens) in responses; None: on without API keys,
    # off with them (vLLM's --enable-prompt-tokens-details is off by default)
    enable_prompt_tokens_details: bool | None = None
    # schedule and send step k+1 before step k's text and events, so the worker never waits
    # on them: "on", "off", or "auto" (on unless the worker computes on the CPU, whose cores
    # the service would take from it)
    overlap: str = "auto"
    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None  # from --admin-token-file or $CADENCE_ADMIN_TOKEN
    # --api-key, --api-key-file, $CADENCE_API_KEY; empty: the inference API is open
    api_keys: list[ApiKey] = field(default_factory=list)
    # Host header names served (DNS rebinding); None: the bound address's names if loopback
    allowed_hosts: list[str] | None = None
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: same origin only
    max_body_bytes: int = 4 * 1024 * 1024
    max_connections: int = 2048  # client connections open at once; the next one gets 503
    # a stream's events its client has not read, in bytes; past it the request ends
    max_stream_buffer_bytes: int = 8 * 1024 * 1024
    # n x (top logprobs + 1) x (echoed prompt + max_tokens) entries one response may hold:
    # each is Python work on the event loop, so a larger product is refused (400)
    max_logprob_entries: int = 131072
    # before a step, the loop waits this long at most for its constrained rows' grammar
    # masks (filled in a thread); a row whose mask is later sits the step out
    grammar_mask_wait_ms: float = 20.0
    # chats: the template (its text; None: the model's), whether a request may bring its
    # own, how tool calls and reasoning are read from the answers (None: not read)
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None
    shutdown_timeout: float = 5.0  # on SIGTERM: drain this long, then close every connection
    served_model_name: str | None = None  # None: derived from the model path
    # logging
    log_file: Path | None = None  # None: JSON lines on stderr
    log_level: str = "info"
    log_iterations: int = 1  # log every Nth iteration line (0: none); requests always logged
    log_max_bytes: int = 64 * 1024 * 1024  # rotate --log-file at this size
    log_backups: int = 3  # rotated files kept (server.jsonl.1 ... .N)
    debug_invariants: bool = False  # check block accounting every iteration

    def isolates_tenants(self) -> bool:
        """Whether the prefix cache is salted by each request's tenant."""
        setting = self.cache_isolation or ("tenant" if self.api_keys else "none")
        return setting == "tenant"

    def reports_cached_tokens(self) -> bool:
        if self.enable_prompt_tokens_details is not None:
            return self.enable_prompt_tokens_details
        return not self.api_keys

    def tenant_share(self) -> float:
        if self.tenant_quota is not None:
            return self.tenant_quota
        return 0.5 if self.api_keys else 1.0
