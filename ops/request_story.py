"""`cadence logs story LOGFILE... REQUEST_ID [--json]`: one request's story from a cadence
JSON log, milestone by milestone, as its trace span tells it (service.tracing.spans):
received, admitted (policy, queue time), each prefill chunk (tokens, step), preempted and
resumed, first token, the largest gap between two of its tokens, finished (reason).

The engine writes each `request.<milestone>` line from the record it hands the tracer, so
the two agree; the largest gap is read from the `request.finished` line's summary.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

PREFIX = "request."
LINE_KEYS = ("ts", "level", "event", "request_id")  # every line's, not the milestone's
FINISHED = "finished"
# the request.finished line's summary of its largest gap, and the milestone's names for it
GAP_FIELDS = {"itl_max_ms": "gap_ms", "itl_max_token": "token"}
FINISH_FIELDS = ("finish_reason", "finish_detail")


@dataclass(slots=True)
class Milestone:
    name: str  # "received", "admitted", "prefill_chunk", ..., "largest_gap", "finished"
    ts: float  # wall clock, seconds (when the line was written)
    fields: dict[str, Any]


def story_of(lines: Iterable[bytes], request_id: str) -> list[Milestone]:
    """The request's milestones in the order they were logged; damaged lines are skipped."""
    story = []
    for raw in lines:
        line = _json(raw)
        if line is None or line.get("request_id") != request_id:
            continue
        event = line.get("event")
        if not isinstance(event, str) or not event.startswith(PREFIX):
            continue
        name = event.removeprefix(PREFIX)
        fields = {k: v for k, v in line.items() if k not in LINE_KEYS}
        ts = float(line.get("ts") or 0.0)
        if name == FINISHED:
            story += _finished(ts, fields)
        else:
            story.append(Milestone(name, ts, fields))
    return story


def _finished(ts: float, fields: dict[str, Any]) -> list[Milestone]:
    """The finished line as two milestones, as the span has them: the largest gap (when
    there were two tokens), then the end with its reason."""
    milestones = []
    if fields.get("itl_max_token") is not None:
        gap = {name: fields[key] for key, name in GAP_FIELDS.items()}
        milestones.append(Milestone("largest_gap", ts, gap))
    end = {key: fields.get(key) for key in FINISH_FIELDS}
    milestones.append(Milestone(FINISHED, ts, end))
    return milestones


def _json(raw: bytes) -> dict[str, Any] | None:
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return line if isinstance(line, dict) else None


def render(request_id: str, story: list[Milestone]) -> str:
    if not story:
        return f"no lines for request {request_id}"
    t0 = story[0].ts
    rows = [f"request {request_id}"]
    for milestone in story:
        fields = " ".join(f"{k}={_value(v)}" for k, v in milestone.fields.items())
        rows.append(f"{(milestone.ts - t0) * 1000:10.1f} ms  {milestone.name:<14} {fields}")
    return "\n".join(rows)


def _value(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence logs story", description=__doc__)
    parser.add_argument("logfiles", type=Path, nargs="+", help="cadence JSON-lines logs")
    parser.add_argument("request_id", help="the request's id (a response's `id`)")
    parser.add_argument("--json", action="store_true", help="one JSON object per milestone")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        lines = [line for path in args.logfiles for line in path.read_bytes().splitlines()]
    except OSError as exc:
        print(f"cadence logs story: {exc}", file=sys.stderr)
        return 1
    story = story_of(lines, args.request_id)
    if args.json:
        for milestone in story:
            record = {"name": milestone.name, "ts": milestone.ts, **milestone.fields}
            print(orjson.dumps(record).decode())
    else:
        print(render(args.request_id, story))
    return 0 if story else 1


if __name__ == "__main__":
    sys.exit(main())
