"""The one configuration object of a cadence server.

Each field that a `cadence serve` flag sets says so in its metadata (`flag(...)`: default,
help and parsing together); service/cli.py builds the flags from them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_worker.protocol import KV_ENGINE_MOONCAKE, QUANTIZATIONS, WorkerConfig
from service.engine.kv_transfer import KV_TRANSFER_ROLES
from service.engine.request import POOLING_TYPES
from service.engine.speculation import SpeculativeConfig
from service.flag_types import (
    chat_template_source,
    fraction,
    hosts,
    kernel_pins,
    non_negative_int,
    origins,
    otlp_endpoint,
    positive_float,
    positive_int,
    ratio,
    share,
    speculative_config,
)
from service.reasoning import PARSERS as REASONING_PARSERS
from service.tool_calls import PARSERS as TOOL_CALL_PARSERS

_WORKER = WorkerConfig(model_dir="")  # the worker's defaults, the server's too
OTLP_PROTOCOLS = ("http/protobuf", "grpc")  # OpenTelemetry's names (service.tracing)


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
    # open connections whose requests came with this key, or with any key of its tenant, at
    # most (service.connections); None: no cap beyond --max-connections
    max_connections: int | None = None
    tenant_max_connections: int | None = None
    # the LoRA adapters its requests may name (None: every one); the base model is always
    # allowed, as a key restricted to adapters is a tenant's, not a ban on the base
    adapters: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Flag:
    """How a Config field is set from the command line (service/cli.py builds the flag)."""

    help: str
    type: Callable[[str], Any] | None = None  # text to value, or an argparse error
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    name: str | None = None  # the flag, when it is not --the-field-name
    show_default: bool = True  # False where the help says what the default means


def flag(
    default: Any = None, help: str = "", *, factory: Callable[[], Any] | None = None, **spec: Any
) -> Any:
    """A Config field that is also a `cadence serve` flag: default, help and parsing in one
    place."""
    metadata = {"flag": Flag(help, **spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class Config:
    # model and worker
    model: str | None = flag(
        None,
        "HF directory, .gguf file or a packaged model's name (gemma3-270m; default: "
        "SmolLM2-135M-Instruct, fetched once)",
    )
    served_model_name: str | None = flag(
        None, "the model's name in the API (default: from --model)"
    )
    dtype: str = flag(
        _WORKER.dtype, "the weights' and activations' dtype", choices=("float32", "bfloat16")
    )
    device: str = flag(_WORKER.device, "auto, cpu, cuda or cuda:N")
    kv_memory: float = flag(
        _WORKER.kv_memory, "<= 1: fraction of free device memory; > 1: bytes", type=positive_float
    )
    kv_cache_dtype: str = flag(
        _WORKER.kv_cache_dtype,
        "auto: the model's dtype; int8 or fp8 (e4m3): 8-bit K/V with a scale per token and "
        "head, 1.9x the blocks in the same memory (README: when to use it; CPU only: "
        "refused on CUDA until its kernels read 8-bit codes)",
        choices=("auto", "bfloat16", "float32", "int8", "fp8"),
    )
    quantization: str = flag(
        _WORKER.quantization,
        "the matmuls' weights: none (--dtype), int8 or int4 (quantized at load, groups of "
        "32), gguf (a .gguf model's own quantized weights); CPU only: refused on CUDA",
        choices=QUANTIZATIONS,
    )
    block_size: int | None = flag(
        _WORKER.block_size,
        "tokens per KV block (default: 64 on CUDA, 16 elsewhere)",
        type=positive_int,
    )
    tensor_parallel_size: int = flag(
        _WORKER.tensor_parallel_size,
        "ranks splitting the model, each with its share of the heads and its own process "
        "(one GPU each, or a share of the CPU's cores); README: when it helps",
        type=positive_int,
    )
    tensor_parallel_size_local: int | None = flag(
        _WORKER.tensor_parallel_size_local,
        "of those, how many this host runs (default: all); the others are started on their "
        "hosts with `python -m gpu_worker.follower --store ADDRESS --rank R` (README)",
        type=positive_int,
    )
    tensor_parallel_address: str | None = flag(
        _WORKER.tensor_parallel_address,
        "HOST:PORT the group's rendezvous store listens on, for ranks on other hosts "
        "(default: loopback, a free port)",
    )
    cpu_threads: int | None = flag(
        _WORKER.cpu_threads,
        "on a CPU, the threads of each rank's model work (default: the cores it may run on, "
        "shared among the host's ranks); fewer leave cores to the HTTP front end (README: "
        "Serving on a CPU)",
        type=positive_int,
    )
    # disaggregated prefill and decode (README: Prefill and decode on two servers)
    kv_transfer_role: str | None = flag(
        None,
        "producer: compute prompts and hold their K/V for a decode server (requests with "
        "kv_transfer_params.do_remote_decode); consumer: pull a producer's K/V and decode "
        "(do_remote_prefill); both (default: neither, kv_transfer_params refused)",
        choices=KV_TRANSFER_ROLES,
    )
    kv_engine: str = flag(
        KV_ENGINE_MOONCAKE,
        "the transfer engine moving K/V between the two (the pd extra installs it)",
        choices=(KV_ENGINE_MOONCAKE,),
        name="--kv-transfer-engine",
    )
    kv_transfer_host: str = flag(
        _WORKER.kv_transfer_host, "the address the transfer engine listens on for consumers"
    )
    kv_staging_tokens: int = flag(
        _WORKER.kv_staging_tokens,
        "a producer's staging arena, in tokens of K/V (memory beside the cache): a held "
        "prompt is gathered into one region a consumer reads in one segment, however "
        "fragmented the caches; 0: none (README: Prefill and decode on two servers)",
        type=non_negative_int,
    )
    kv_hold_timeout: float = flag(
        30.0,
        "seconds a producer holds a prompt's K/V for the consumer's pull before freeing it",
        type=positive_float,
    )
    kv_transfer_timeout: float = flag(
        _WORKER.kv_transfer_timeout,
        "seconds a consumer's pull of a prompt's K/V may take before its request ends "
        "kv_transfer_failed (never recomputed)",
        type=positive_float,
    )
    cache_dir: Path = flag(
        help="converted models and measured kernel choices (default: $CADENCE_CACHE, "
        "$XDG_CACHE_HOME/cadence or ~/.cache/cadence)",
        factory=default_cache_dir,
        type=Path,
        show_default=False,
    )
    use_cuda_graphs: bool = flag(
        _WORKER.use_cuda_graphs,
        "capture decode steps as CUDA graphs (on a GPU)",
        name="--cuda-graphs",
    )
    kernels: str = flag(
        _WORKER.kernels,
        "'auto' (measure the candidates on this machine, cached per machine) or pins such as "
        "'attention=native-rows,matmul=aten' (seams: attention, layer_ops, matmul)",
        type=kernel_pins,
    )
    seed: int = flag(_WORKER.seed, "the sampler's seed for requests without their own", type=int)
    # supervision of the worker
    step_timeout: float = flag(
        30.0,
        "seconds a worker step (or an idle ping) may take before the worker is restarted",
        type=positive_float,
    )
    max_worker_restarts: int = flag(
        5,
        "failed worker starts in a row before the server fails its queue and exits 1",
        type=positive_int,
    )
    # scheduling
    policy: str = flag("stall_free", "the scheduling policy (README: Policies)")
    policy_params: dict[str, Any] = field(default_factory=dict)  # --policy-param KEY=VALUE
    max_batched_tokens: int = flag(
        _WORKER.max_num_batched_tokens,
        "hard cap of tokens in one step, whatever the policy says",
        type=positive_int,
    )
    max_num_seqs: int = flag(
        _WORKER.max_num_seqs, "sequences in one step at most", type=positive_int
    )
    max_queue: int = flag(
        1024, "waiting requests beyond this get 429 overloaded", type=positive_int
    )
    max_queued_tokens: int = flag(
        262144,
        "prompt tokens waiting to start beyond this get 429 (never less than one full-window "
        "prompt)",
        type=positive_int,
    )
    tenant_quota: float | None = flag(
        None,
        "the share of --max-queue, --max-queued-tokens and the KV blocks one tenant may take "
        "(its requests' n x (prompt + max_tokens)); more gets 429 (default: 0.5 with API keys, "
        "else 1, no quota)",
        type=share,
    )
    max_queue_time: float | None = flag(
        None,
        "seconds a request may wait to start; later it ends with 429 deadline_exceeded, and "
        "one predicted not to start in time gets 429 at arrival (default: no limit)",
        type=positive_float,
    )
    max_predicted_ttft: float | None = flag(
        None,
        "refuse at arrival (429 + Retry-After) a request whose TTFT, predicted from the queue "
        "ahead and the measured step costs, exceeds this many seconds (default: off)",
        type=positive_float,
    )
    max_model_len: int | None = flag(
        None,
        "cap on prompt + completion tokens (default: the model's context window)",
        type=positive_int,
    )
    watermark: float = 0.01  # fraction of KV blocks kept free when admitting
    admission_watermark: float = flag(
        0.05,
        "after a preemption, admit nobody until this fraction of the KV blocks is free and "
        "unpromised again (hysteresis; keep it above the 0.01 admission watermark)",
        type=fraction,
    )
    max_preemptions: int = flag(
        3,
        "a request preempted this many times is never preempted again (0: never preempt)",
        type=non_negative_int,
    )
    enable_prefix_caching: bool = flag(
        True,
        "share the KV blocks of prompt prefixes computed before (hash-chained full blocks, "
        "LRU-evicted; vLLM's flag, --no-enable-prefix-caching turns it off)",
    )
    cache_isolation: str | None = flag(
        None,
        "tenant: cached prefixes are shared only within a tenant (default with API keys); "
        "none: by every request (default without)",
        choices=("none", "tenant"),
    )
    enable_prompt_tokens_details: bool | None = flag(
        None,
        "report usage.prompt_tokens_details.cached_tokens (vLLM's flag; default: on without "
        "API keys, off with them)",
    )
    overlap: str = flag(
        "auto",
        "schedule step k+1 before step k's text and events; auto: every step, except that on "
        "a CPU only steps of at most 4 sequences do (a full batch's part would take cores "
        "from the worker)",
        choices=("auto", "on", "off"),
    )
    speculative_config: SpeculativeConfig | None = flag(
        None,
        'speculative decoding, vLLM\'s JSON: n-gram {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}, '
        'and cadence\'s "step_cost_tolerance" (0.05: drafts may make a step that much '
        'slower, by the measured step costs); or a draft model\'s: {"model": PATH, '
        '"num_speculative_tokens": 3, "quantization": "none"} (default: off)',
        type=speculative_config,
        metavar="JSON",
        show_default=False,
    )
    # LoRA adapters (README: LoRA adapters)
    enable_lora: bool = flag(
        False, "serve PEFT LoRA adapters of the model, each request naming one by its `model`"
    )
    lora_modules: list[tuple[str, str]] = field(default_factory=list)  # --lora-modules (cli.py)
    max_loras: int = flag(
        4,
        "with --enable-lora, the adapters the worker holds at once (its slots); requests for "
        "more are admitted in turn (vLLM's default is 1, which serialises any two adapters)",
        type=positive_int,
    )
    max_lora_rank: int = flag(
        _WORKER.max_lora_rank,
        "with --enable-lora, the largest rank an adapter may have (each slot is that wide)",
        type=positive_int,
    )
    # HTTP
    host: str = flag("127.0.0.1", "the address to listen on")
    port: int = flag(8000, "0 picks a free port", type=int)
    admin_token: str | None = None  # from --admin-token-file or $CADENCE_ADMIN_TOKEN
    # --api-key, --api-key-file, $CADENCE_API_KEY; empty: the inference API is open
    api_keys: list[ApiKey] = field(default_factory=list)
    allowed_hosts: list[str] | None = flag(
        None,
        "Host header names served (DNS rebinding), with or without a port: JSON list or "
        'comma-separated, "*" for any (default: localhost, 127.0.0.1, [::1] when bound to '
        "loopback, else any)",
        type=hosts,
    )
    allowed_origins: list[str] = flag(
        help="origins allowed to call /v1 from a browser (CORS): JSON list or comma-separated, "
        '"*" for any (default: none; /admin never)',
        factory=list,
        type=origins,
        show_default=False,
    )
    max_body_bytes: int = flag(4 * 1024 * 1024, "largest request body", type=positive_int)
    max_connections: int = flag(
        2048,
        "client connections open at once; at the cap the one stalled longest without a "
        "request being answered is closed to make room (none such: the newcomer gets 503)",
        type=positive_int,
    )
    head_timeout: float = flag(
        5.0,
        "seconds a connection may sit without sending a whole request head (idle between "
        "requests included) before it is closed",
        type=positive_float,
    )
    body_timeout: float = flag(
        10.0,
        "seconds a request's body may take to arrive once its head has; later: 408, closed",
        type=positive_float,
    )
    max_stream_buffer_bytes: int = flag(
        8 * 1024 * 1024,
        "a stream's events its client has not read yet, in bytes; a client that falls further "
        "behind has its request ended (the stream's last event is the error)",
        type=positive_int,
    )
    max_logprob_entries: int = flag(
        131072,
        "refuse (400) a request whose n x (logprobs + 1) x (echoed prompt + max_tokens) "
        "exceeds this: every entry is work on the event loop every stream shares",
        type=positive_int,
    )
    grammar_mask_wait_ms: float = flag(
        20.0,
        "before a step, wait at most this long for its structured-output rows' grammar masks "
        "(filled in a thread); a row whose mask is later sits that step out, so a slow grammar "
        "cannot hold the other streams",
        type=positive_float,
    )
    # chats: how they are rendered, and how their answers are read
    chat_template: str | None = flag(
        None,
        "the chat template: a file, or the Jinja text itself (default: the model's)",
        type=chat_template_source,
        metavar="FILE_OR_TEMPLATE",
    )
    trust_request_chat_template: bool = flag(
        False, "accept a request's own 'chat_template' (else a 400), as vLLM's flag"
    )
    tool_call_parser: str | None = flag(
        None,
        "how the model writes tool calls, read for tool_choice auto (without it, auto is a "
        "400; required and a named function need none: a grammar writes those)",
        choices=tuple(sorted(TOOL_CALL_PARSERS)),
    )
    exclude_tools_when_tool_choice_none: bool = flag(
        False, "with tool_choice none, do not show the tools to the chat template"
    )
    reasoning_parser: str | None = flag(
        None,
        "return the model's <think>...</think> apart, as reasoning_content",
        choices=REASONING_PARSERS,
    )
    pooling_type: str = flag(
        "last",
        "how /v1/embeddings pools the prompt's final hidden states: the last token's "
        "(vLLM's default for a decoder model) or their mean",
        choices=POOLING_TYPES,
    )
    shutdown_timeout: float = flag(
        5.0,
        "seconds to let requests finish after SIGTERM before connections are closed",
        type=positive_float,
    )
    # logging
    log_file: Path | None = flag(None, "JSON lines (default: stderr)", type=Path)
    log_level: str = flag(
        "info", "the least severe level logged", choices=("debug", "info", "warning", "error")
    )
    log_iterations: int = flag(
        1,
        "log every Nth iteration (0: none; request events are always logged)",
        type=non_negative_int,
        metavar="N",
    )
    log_max_bytes: int = flag(
        64 * 1024 * 1024, "rotate --log-file when it reaches this size", type=positive_int
    )
    log_backups: int = flag(
        3, "rotated log files kept (server.jsonl.1 ... .N)", type=non_negative_int
    )
    debug_invariants: bool = flag(False, "check KV block accounting every iteration")
    # tracing (the optional extra `otel`: service.tracing)
    otlp_traces_endpoint: str | None = flag(
        None,
        "send a span per request to this OpenTelemetry collector (OTLP, e.g. "
        "http://HOST:4318/v1/traces, or grpc://HOST:4317); needs pip install 'cadence[otel]'",
        type=otlp_endpoint,
        metavar="URL",
    )
    otlp_traces_protocol: str | None = flag(
        None,
        "default: grpc for a grpc:// URL, else $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or "
        "http/protobuf",
        choices=OTLP_PROTOCOLS,
    )
    otlp_trace_steps: float = flag(
        0.0,
        "the fraction of worker steps traced as spans of their own (plan size, tokens, step "
        "ms), evenly spread; 0: none",
        type=ratio,
        metavar="RATIO",
    )
    enable_per_request_metrics: bool = flag(
        False,
        "add vLLM's per-request `metrics` object (queue, prefill and decode times) to "
        "completions, chat completions and responses",
    )

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
