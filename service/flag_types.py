"""How a command-line flag's text becomes a Config value, or a clear argparse error.

Config's fields name these in their metadata (service/config.py); the CLI builds its flags
from the fields (service/cli.py), so each check is written once for every command.
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
from pathlib import Path

from gpu_worker.protocol import parse_kernel_pins
from service.engine.speculation import SpeculativeConfig, parse_speculative_config


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


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
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


def ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be >= 0 and <= 1, got {value}")
    return value


def otlp_endpoint(text: str) -> str:
    """An OpenTelemetry collector's URL: http(s)://HOST[:PORT][/PATH] or grpc://HOST:PORT."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https", "grpc") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"expected http(s)://HOST or grpc://HOST, got {text!r}")
    return text


def kernel_pins(text: str) -> str:
    try:
        parse_kernel_pins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def speculative_config(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def origins(text: str) -> list[str]:
    """vLLM's form (a JSON list) or a comma-separated list."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [part.strip() for part in text.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f"expected a list of origins, got {text!r}")
    return value


def hosts(text: str) -> list[str]:
    """Host names as --allowed-origins takes origins; lower-cased, as DNS compares them."""
    return [host.lower() for host in origins(text)]


def key_value(text: str) -> tuple[str, object]:
    """KEY=VALUE, VALUE decoded as JSON when it parses (so numbers and lists keep their type)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def chat_template_source(text: str) -> str:
    """--chat-template: a file's text, or the template itself when it holds Jinja."""
    path = Path(text)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in text or "{%" in text:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a file nor a Jinja template")


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules: NAME=PATH, or vLLM's JSON {"name": ..., "path": ...,
    "base_model_name": ...} (the base is the served model whatever it says)."""
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
        name, path = given.get("name"), given.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(
            f'expected NAME=PATH or {{"name": .., "path": ..}}, got {text!r}'
        )
    return name, path
