"""The one structlog setup: JSON lines (orjson) with "ts", "level" and "event" first."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import structlog

_LEADING_KEYS = ("ts", "level", "event")
_open_log_file: BinaryIO | None = None


def _add_unix_timestamp(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict["ts"] = time.time()
    return event_dict


def _leading_keys_first(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    # Readers (people and ops/logs_report) scan the first keys; keep them in a fixed order.
    ordered = {key: event_dict.pop(key) for key in _LEADING_KEYS if key in event_dict}
    ordered.update(event_dict)
    return ordered


def _orjson_dumps(obj: Any, default: Any = None) -> bytes:
    return orjson.dumps(obj, default=default, option=orjson.OPT_SERIALIZE_NUMPY)


def configure_logging(log_file: Path | None, level: str = "info") -> None:
    """Send every structlog event, one JSON object per line, to `log_file` (or stderr)."""
    global _open_log_file
    level_number = logging.getLevelName(level.upper())
    if not isinstance(level_number, int):
        raise ValueError(f"unknown log level {level!r}")
    if _open_log_file is not None:
        _open_log_file.close()
        _open_log_file = None
    if log_file is None:
        sink: BinaryIO = sys.stderr.buffer
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered-ish: one write per event, so a tail -f sees whole lines at once.
        sink = _open_log_file = open(log_file, "ab", buffering=0)  # noqa: SIM115
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_unix_timestamp,
            structlog.processors.format_exc_info,
            _leading_keys_first,
            structlog.processors.JSONRenderer(serializer=_orjson_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        logger_factory=structlog.BytesLoggerFactory(file=sink),
        cache_logger_on_first_use=False,
    )
