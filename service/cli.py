"""The `cadence` command: serve, fetch-model, and the ops tools (bench, logs)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import fields
from functools import partial
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import trio

from gpu_worker.protocol import parse_kernel_pins
from service.config import ApiKey, Config, default_cache_dir

TOOL_COMMANDS = "cadence.commands"  # entry-point group: commands other packages provide


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    tools = tool_commands()
    if argv and argv[0] in tools:
        return int(tools[argv[0]].load()(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return args.run(args)


def tool_commands() -> dict[str, EntryPoint]:
    """Commands registered by installed tool packages (ops registers bench and logs)."""
    return {ep.name: ep for ep in entry_points(group=TOOL_COMMANDS)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the OpenAI-compatible server")
    add_serve_args(serve)
    serve.set_defaults(run=partial(run_serve, serve))
    fetch = commands.add_parser("fetch-model", help="fetch and convert the default model once")
    fetch.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    fetch.add_argument("--cache-dir", type=Path, default=None)
    fetch.set_defaults(run=run_fetch_model)
    for name, ep in tool_commands().items():
        commands.add_parser(name, help=f"see `cadence {name} --help` ({ep.value})", add_help=False)
    return parser


def add_serve_args(p: argparse.ArgumentParser) -> None:
    defaults = Config()
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port, help="0 picks a free port")
    p.add_argument(
        "--model",
        default=None,
        help="HF directory or .gguf file (default: SmolLM2-135M-Instruct, fetched once)",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=defaults.dtype)
    p.add_argument("--device", default=defaults.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--policy", default=defaults.policy)
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=parse_key_value,
        help="repeatable; VALUE is JSON when it parses",
    )
    p.add_argument("--max-batched-tokens", type=positive_int, default=defaults.max_batched_tokens)
    p.add_argument("--max-num-seqs", type=positive_int, default=defaults.max_num_seqs)
    p.add_argument(
        "--kv-memory",
        type=positive_float,
        default=defaults.kv_memory,
        help="<= 1: fraction of free device memory; > 1: bytes",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16", "float32", "int8", "fp8"],
        default=defaults.kv_cache_dtype,
        help="auto: the model's dtype; int8 or fp8 (e4m3): 8-bit K/V with a scale per token "
        "and head, 1.9x the blocks in the same memory (README: when to use it)",
    )
    p.add_argument("--block-size", type=positive_int, default=defaults.block_size)
    p.add_argument("--max-queue", type=positive_int, default=defaults.max_queue)
    p.add_argument(
        "--max-queued-tokens",
        type=positive_int,
        default=defaults.max_queued_tokens,
        help="prompt tokens waiting to start beyond this get 429 (never less than one "
        "full-window prompt)",
    )
    p.add_argument(
        "--tenant-quota",
        type=share,
        default=None,
        help="the share of --max-queue, --max-queued-tokens and the KV blocks one tenant may "
        "take (its requests' n x (prompt + max_tokens)); more gets 429 (default: 0.5 with API "
        "keys, else 1, no quota)",
    )
    p.add_argument(
        "--max-queue-time",
        type=positive_float,
        default=None,
        help="seconds a request may wait to start; later it ends with 429 deadline_exceeded, "
        "and one predicted not to start in time gets 429 at arrival (default: no limit)",
    )
    p.add_argument(
        "--max-predicted-ttft",
        type=positive_float,
        default=None,
        help="refuse at arrival (429 + Retry-After) a request whose TTFT, predicted from the "
        "queue ahead and the measured step costs, exceeds this many seconds (default: off)",
    )
    p.add_argument(
        "--admission-watermark",
        type=fraction,
        default=defaults.admission_watermark,
        help="after a preemption, admit nobody until this fraction of the KV blocks is free "
        "and unpromised again (hysteresis; keep it above the 0.01 admission watermark)",
    )
    p.add_argument(
        "--max-preemptions",
        type=non_negative_int,
        default=defaults.max_preemptions,
        help="a request preempted this many times is never preempted again (0: never preempt)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults.enable_prefix_caching,
        help="share the KV blocks of prompt prefixes computed before (vLLM's flag; on by "
        "default, --no-enable-prefix-caching turns it off)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="cap on prompt + completion tokens (default: the model's context window)",
    )
    p.add_argument("--max-body-bytes", type=positive_int, default=defaults.max_body_bytes)
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=defaults.max_connections,
        help="client connections open at once; one more gets 503 and is closed",
    )
    p.add_argument(
        "--max-logprob-entries",
        type=positive_int,
        default=defaults.max_logprob_entries,
        help="refuse (400) a request whose n x (logprobs + 1) x (echoed prompt + max_tokens) "
        "exceeds this: every entry is work on the event loop every stream shares",
    )
    p.add_argument(
        "--max-stream-buffer-bytes",
        type=positive_int,
        default=defaults.max_stream_buffer_bytes,
        help="a stream's events its client has not read yet, in bytes; a client that falls "
        "further behind has its request ended (the stream's last event is the error)",
    )
    p.add_argument(
        "--grammar-mask-wait-ms",
        type=positive_float,
        default=defaults.grammar_mask_wait_ms,
        help="before a step, wait at most this long for its structured-output rows' grammar "
        "masks (filled in a thread); a row whose mask is later sits that step out, so a slow "
        "grammar cannot hold the other streams",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="file holding the bearer token for /admin (default: $CADENCE_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help="the token itself; visible in `ps`, prefer --admin-token-file",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key every inference request must send as 'Authorization: Bearer KEY' "
        "(repeatable; visible in `ps`, prefer --api-key-file or $CADENCE_API_KEY)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="one key a line: KEY [TENANT [priority]]; '#' starts a comment",
    )
    p.add_argument(
        "--allowed-hosts",
        type=parse_hosts,
        default=None,
        help="Host header names served, with or without a port: JSON list or comma-separated, "
        '"*" for any (default: localhost, 127.0.0.1, [::1] when bound to loopback, else any)',
    )
    p.add_argument(
        "--cache-isolation",
        choices=["none", "tenant"],
        default=None,
        help="tenant: cached prefixes are shared only within a tenant (default with API keys); "
        "none: by every request (default without)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag; default: on "
        "without API keys, off with them)",
    )
    p.add_argument(
        "--allowed-origins",
        type=parse_origins,
        default=[],
        help='origins allowed to call /v1 from a browser: JSON list or comma-separated, "*" '
        "for any (default: none; /admin never)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        default=defaults.shutdown_timeout,
        help="seconds to let requests finish after SIGTERM before connections are closed",
    )
    p.add_argument(
        "--step-timeout",
        type=positive_float,
        default=defaults.step_timeout,
        help="seconds a worker step (or an idle ping) may take before the worker is restarted",
    )
    p.add_argument(
        "--max-worker-restarts",
        type=positive_int,
        default=defaults.max_worker_restarts,
        help="failed worker starts in a row before the server fails its queue and exits 1",
    )
    p.add_argument("--log-file", type=Path, default=None, help="JSON lines (default: stderr)")
    p.add_argument(
        "--log-level", default=defaults.log_level, choices=["debug", "info", "warning", "error"]
    )
    p.add_argument(
        "--log-iterations",
        type=non_negative_int,
        default=defaults.log_iterations,
        metavar="N",
        help="log every Nth iteration (0: none; request events are always logged)",
    )
    p.add_argument(
        "--log-max-bytes",
        type=positive_int,
        default=defaults.log_max_bytes,
        help="rotate --log-file when it reaches this size",
    )
    p.add_argument(
        "--log-backups",
        type=non_negative_int,
        default=defaults.log_backups,
        help="rotated log files kept",
    )
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument(
        "--kernels",
        type=kernel_pins,
        default=defaults.kernels,
        help="'auto' (measure the candidates on this machine, cached per machine) or pins "
        "such as 'attention=native-rows,matmul=aten' (seams: attention, layer_ops, matmul)",
    )
    p.add_argument(
        "--debug-invariants", action="store_true", help="check KV block accounting every iteration"
    )
    p.add_argument(
        "--overlap",
        choices=["auto", "on", "off"],
        default=defaults.overlap,
        help="schedule step k+1 before step k's text and events; auto: unless the worker "
        "computes on the CPU, whose cores the service would take from it",
    )
    add_chat_args(p)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """How chats are rendered and their answers read: templates, tool calls, reasoning."""
    from service import reasoning
    from service.tool_calls import PARSERS

    p.add_argument(
        "--chat-template",
        type=chat_template_source,
        default=None,
        help="the chat template: a file, or the Jinja text itself (default: the model's)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a request's own 'chat_template' (else a 400), as vLLM's flag",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="how the model writes tool calls, read for tool_choice auto (without it, auto "
        "is a 400; required and a named function need none: a grammar writes those)",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="with tool_choice none, do not show the tools to the chat template",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=reasoning.PARSERS,
        default=None,
        help="return the model's <think>...</think> apart, as reasoning_content",
    )


def chat_template_source(text: str) -> str:
    """--chat-template: a file's text, or the template itself when it holds Jinja."""
    path = Path(text)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in text or "{%" in text:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a file nor a Jinja template")


def parse_key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def kernel_pins(text: str) -> str:
    try:
        parse_kernel_pins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 1, got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 0 and < 1, got {value}")
    return value


def parse_origins(text: str) -> list[str]:
    """vLLM's form (a JSON list) or a comma-separated list."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [part.strip() for part in text.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f"expected a list of origins, got {text!r}")
    return value


def parse_hosts(text: str) -> list[str]:
    """Host names as --allowed-origins takes origins; lower-cased, as DNS compares them."""
    return [host.lower() for host in parse_origins(text)]


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def config_from_args(args: argparse.Namespace) -> Config:
    """Flags map onto Config fields by name; the few that do not are translated here."""
    given = vars(args)
    config = Config(**{f.name: given[f.name] for f in fields(Config) if f.name in given})
    config.cache_dir = args.cache_dir or default_cache_dir()
    config.use_cuda_graphs = not args.no_cuda_graphs
    config.policy_params = dict(args.policy_param)
    config.admin_token = admin_token_of(args)
    config.api_keys = api_keys_of(args)
    return config


def admin_token_of(args: argparse.Namespace) -> str | None:
    """--admin-token-file, else --admin-token, else $CADENCE_ADMIN_TOKEN; blank means none."""
    if args.admin_token_file is not None:
        try:
            token = args.admin_token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise SystemExit(f"cadence: --admin-token-file: {exc}") from None
        return token or None
    return args.admin_token or os.environ.get("CADENCE_ADMIN_TOKEN") or None


def api_keys_of(args: argparse.Namespace) -> list[ApiKey]:
    """--api-key, --api-key-file and $CADENCE_API_KEY together; none: the API is open."""
    keys = [*args.api_key, *filter(None, [os.environ.get("CADENCE_API_KEY")])]
    found = [ApiKey(key, default_tenant(key)) for key in keys if key.strip()]
    if args.api_key_file is not None:
        try:
            text = args.api_key_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise SystemExit(f"cadence: --api-key-file: {exc}") from None
        try:
            found += parse_api_key_file(text)
        except ValueError as exc:
            raise SystemExit(f"cadence: --api-key-file: {exc}") from None
    return found


MAX_KEY_TENANT_CHARS = 64  # the key's tenant; a client's sub-tenant goes after a "/"


KEY_PERMISSIONS = ("priority", "metrics")


def parse_api_key_file(text: str) -> list[ApiKey]:
    """Lines of `KEY [TENANT [PERMISSIONS]]`; PERMISSIONS is `-` or a comma-separated list
    of `priority` (the key's clients may set `priority`) and `metrics` (they may read
    /metrics). A key without a tenant gets one of its own."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 3:
            raise ValueError(f"line {number}: expected KEY [TENANT [PERMISSIONS]]")
        key, tenant, permissions = (*words, None, None)[:3]
        tenant = tenant or default_tenant(key)
        if "/" in tenant or len(tenant) > MAX_KEY_TENANT_CHARS:
            raise ValueError(
                f"line {number}: a tenant name has at most {MAX_KEY_TENANT_CHARS} characters "
                "and no '/'"
            )
        granted = key_permissions(permissions, number)
        keys.append(
            ApiKey(
                key,
                tenant,
                may_set_priority="priority" in granted,
                may_read_metrics="metrics" in granted,
            )
        )
    return keys


def key_permissions(text: str | None, number: int) -> set[str]:
    if text in (None, "-"):
        return set()
    granted = set(text.split(","))
    unknown = granted - set(KEY_PERMISSIONS)
    if unknown:
        raise ValueError(
            f"line {number}: unknown permission {sorted(unknown)[0]!r} "
            f"({', '.join(KEY_PERMISSIONS)})"
        )
    return granted


def default_tenant(key: str) -> str:
    """A name for a key's tenant that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def run_fetch_model(args: argparse.Namespace) -> int:
    from service.model_files.resolve import ModelFileError, print_progress, resolve_model

    try:
        path = resolve_model(
            args.model, args.cache_dir or default_cache_dir(), progress=print_progress
        )
    except ModelFileError as exc:
        print(f"cadence: {exc}", file=sys.stderr)
        return 1
    print(path, flush=True)
    return 0


def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from policies.base import PolicyError
    from policies.registry import make_policy

    config = config_from_args(args)
    try:
        make_policy(config.policy, config.policy_params)
    except PolicyError as exc:
        parser.error(f"--policy {config.policy}: {exc}")  # exits 2
    from service.model_files.resolve import ModelFileError
    from service.server import build_server

    try:
        server = build_server(config)
    except ModelFileError as exc:
        print(f"cadence: {exc}", file=sys.stderr)
        return 1
    return trio.run(server.serve)


if __name__ == "__main__":
    sys.exit(main())
