"""Reads cadence's structlog JSON lines into plain records, tolerating damage.

A line that is not JSON (a log cut off mid-line), has no event name, or lacks a field a
known event needs is skipped and counted by reason; events this reader does not know are
counted by name. Extra fields (a newer format) are ignored. Nothing here raises on content.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

NOT_JSON = "not JSON (cut off or corrupt)"
NOT_EVENT = "JSON without an event name"


@dataclass(slots=True)
class Iteration:
    ts: float
    iteration: int
    policy: str
    prefill_tokens: int
    decode_seqs: int
    batch_tokens: int
    step_ms: float
    kv_blocks_used: int
    kv_blocks_total: int
    schedule_ms: float | None = None
    running: int | None = None
    waiting: int | None = None
    preempted: int | None = None


@dataclass(slots=True)
class Swap:
    ts: float
    old: str
    new: str
    iteration: int | None = None
    by: str | None = None


@dataclass(slots=True)
class FinishedRequest:
    ts: float
    request_id: str
    tenant: str
    policy: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None = None  # None when it never produced a token
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    queue_ms: float | None = None
    e2e_ms: float | None = None
    finish_detail: str | None = None
    preemptions: int | None = None


@dataclass(slots=True)
class ParsedLog:
    lines: int = 0
    iterations: list[Iteration] = field(default_factory=list)
    swaps: list[Swap] = field(default_factory=list)
    requests: list[FinishedRequest] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> lines
    other_events: Counter[str] = field(default_factory=Counter)  # event name -> lines

    @property
    def start_ts(self) -> float | None:
        stamps = [r.ts for group in (self.iterations, self.swaps, self.requests) for r in group]
        return min(stamps) if stamps else None


NUMBER = "number"
TEXT = "text"
OPTIONAL_NUMBER = "number or null"
OPTIONAL_TEXT = "text or null"

SCHEMAS: dict[str, tuple[type, dict[str, str]]] = {
    "iteration": (
        Iteration,
        {
            "ts": NUMBER,
            "iteration": NUMBER,
            "policy": TEXT,
            "prefill_tokens": NUMBER,
            "decode_seqs": NUMBER,
            "batch_tokens": NUMBER,
            "step_ms": NUMBER,
            "kv_blocks_used": NUMBER,
            "kv_blocks_total": NUMBER,
            "schedule_ms": OPTIONAL_NUMBER,
            "running": OPTIONAL_NUMBER,
            "waiting": OPTIONAL_NUMBER,
            "preempted": OPTIONAL_NUMBER,
        },
    ),
    "policy.swap": (
        Swap,
        {
            "ts": NUMBER,
            "old": TEXT,
            "new": TEXT,
            "iteration": OPTIONAL_NUMBER,
            "by": OPTIONAL_TEXT,
        },
    ),
    "request.finished": (
        FinishedRequest,
        {
            "ts": NUMBER,
            "request_id": TEXT,
            "tenant": TEXT,
            "policy": TEXT,
            "finish_reason": TEXT,
            "prompt_tokens": NUMBER,
            "completion_tokens": NUMBER,
            "ttft_ms": OPTIONAL_NUMBER,
            "itl_p50_ms": OPTIONAL_NUMBER,
            "itl_p99_ms": OPTIONAL_NUMBER,
            "itl_max_ms": OPTIONAL_NUMBER,
            "queue_ms": OPTIONAL_NUMBER,
            "e2e_ms": OPTIONAL_NUMBER,
            "finish_detail": OPTIONAL_TEXT,
            "preemptions": OPTIONAL_NUMBER,
        },
    ),
}
TARGETS = {"iteration": "iterations", "policy.swap": "swaps", "request.finished": "requests"}


def _fits(value: Any, kind: str) -> bool:
    if value is None:
        return kind in (OPTIONAL_NUMBER, OPTIONAL_TEXT)
    if kind in (NUMBER, OPTIONAL_NUMBER):
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)


def _policy_name(value: Any) -> Any:
    """Swap lines may carry a policy as {"name", "params"} rather than a bare name."""
    return value.get("name") if isinstance(value, dict) else value


def to_record(event: str, obj: dict[str, Any]) -> Any | None:
    """The record of a known event, or None when a needed field is missing or mistyped."""
    cls, schema = SCHEMAS[event]
    values = {}
    for name, kind in schema.items():
        value = obj.get(name)
        if event == "policy.swap" and name in ("old", "new"):
            value = _policy_name(value)
        if not _fits(value, kind):
            return None
        values[name] = value
    return cls(**values)


def parse_line(raw: bytes, log: ParsedLog) -> None:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        log.skipped[NOT_JSON] += 1
        return
    event = obj.get("event") if isinstance(obj, dict) else None
    if not isinstance(event, str):
        log.skipped[NOT_EVENT] += 1
        return
    if event not in SCHEMAS:
        log.other_events[event] += 1
        return
    record = to_record(event, obj)
    if record is None:
        log.skipped[f"{event}: missing or mistyped fields (other format)"] += 1
        return
    getattr(log, TARGETS[event]).append(record)


def parse_lines(lines: list[bytes]) -> ParsedLog:
    log = ParsedLog()
    for raw in lines:
        if raw.strip():
            log.lines += 1
            parse_line(raw, log)
    return log


def parse_log(path: Path) -> ParsedLog:
    return parse_lines(path.read_bytes().split(b"\n"))
