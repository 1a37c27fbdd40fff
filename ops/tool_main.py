"""The shape of every `cadence bench` tool's main: parse the flags, measure, report.

A usage error is argparse's exit status (2, its message printed); a bad knob found while
preparing (ValueError: PromptError, ModelFileError, a refused policy) is exit 2 with the
message; a server that cannot be reached is exit 1. The report decides the rest (0, or 1
when requests failed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

import httpx

Measured = TypeVar("Measured")


def run_tool(
    prog: str,
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    measure: Callable[[argparse.Namespace], Measured],
    report: Callable[[argparse.Namespace, Measured], int],
    bad_input: tuple[type[Exception], ...] = (ValueError,),
) -> int:
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error already printed by argparse
        return int(exc.code or 0)
    try:
        measured = measure(args)
    except bad_input as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, OSError) as exc:
        print(f"{prog}: cannot reach {_servers(args)}: {exc}", file=sys.stderr)
        return 1
    return report(args, measured)


def _servers(args: argparse.Namespace) -> str:
    url = getattr(args, "url", None)
    if isinstance(url, list):
        return "a server of " + ", ".join(url)
    return str(url or "the server")
