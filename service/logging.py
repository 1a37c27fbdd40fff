"""The one structlog setup: JSON lines (orjson) with "ts", "level" and "event" first.

Logging must never stop the engine. A pipe or socket nobody drains would block a plain
write forever, so lines go to a descriptor that does not block: whatever the reader does not
take yet waits, in order, in a bounded buffer of whole lines; past that, lines are dropped
and counted, and a `log.dropped` line says how many once the reader takes lines again.
A --log-file is rotated on a line boundary (like logging.handlers.RotatingFileHandler), so
it cannot fill the disk either.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import orjson
import structlog
from structlog.typing import EventDict

from service.config import Config

_LEADING_KEYS = ("ts", "level", "event")
_PENDING_LIMIT = 1 << 20  # bytes of lines kept for a reader that has fallen behind
_DEFAULTS = Config()  # the one place for the log files' default size and count

_lines_dropped = 0  # since the process started, whatever sink dropped them
_sink: LineSink | None = None


def _add_unix_timestamp(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    event_dict["ts"] = time.time()
    return event_dict


def _leading_keys_first(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    # Readers (people and ops/logs_report) scan the first keys; keep them in a fixed order.
    ordered = {key: event_dict.pop(key) for key in _LEADING_KEYS if key in event_dict}
    ordered.update(event_dict)
    return ordered


def _orjson_dumps(obj: Any, default: Any = None) -> bytes:
    return orjson.dumps(obj, default=default, option=orjson.OPT_SERIALIZE_NUMPY)


def log_lines_dropped() -> int:
    """Log lines dropped since the process started because the log's reader fell behind."""
    return _lines_dropped


def configure_logging(
    log_file: Path | None,
    level: str = "info",
    *,
    max_bytes: int = _DEFAULTS.log_max_bytes,
    backups: int = _DEFAULTS.log_backups,
) -> None:
    """Send every structlog event, one JSON object per line, to `log_file` (or stderr).
    A log file is rotated before it would pass `max_bytes`, keeping `backups` older files
    (name.1, the newest, to name.N)."""
    global _sink
    level_number = logging.getLevelName(level.upper())
    if not isinstance(level_number, int):
        raise ValueError(f"unknown log level {level!r}")
    if _sink is not None:
        _sink.close()
    if log_file is None:
        _sink = LineSink(_open_stderr(), rotation=None)
    else:
        rotation = Rotation(log_file, max_bytes, backups)
        _sink = LineSink(rotation.open(truncate=False), rotation)
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
        # it uses only write and flush, which the sink has
        logger_factory=structlog.BytesLoggerFactory(file=cast(BinaryIO, _sink)),
        cache_logger_on_first_use=False,
    )


@dataclass(slots=True)
class Channel:
    """Where bytes go: `send` takes what it can now and says how many bytes (raising
    BlockingIOError when it takes none); it never waits for the reader."""

    send: Callable[[bytes | bytearray], int]
    close: Callable[[], None]


def _fd_channel(fd: int) -> Channel:
    return Channel(lambda data: os.write(fd, data), lambda: os.close(fd))


def _open_stderr() -> Channel:
    mode = os.fstat(2).st_mode
    if stat.S_ISSOCK(mode):
        # journald's socket: a socket cannot be opened again, so each send says not to wait.
        sock = socket.socket(fileno=os.dup(2))
        return Channel(lambda data: sock.send(data, socket.MSG_DONTWAIT), sock.close)
    if stat.S_ISREG(mode):
        # A file never blocks, and a description of our own would write over fd 2's offset.
        return _fd_channel(os.dup(2))
    try:
        # A pipe or terminal opened anew: O_NONBLOCK applies to this open file description
        # only, so fd 2 (shared with the worker and any child) stays blocking.
        return _fd_channel(os.open("/proc/self/fd/2", os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no /proc (not Linux): plain stderr, which may block
        return _fd_channel(os.dup(2))


@dataclass(slots=True)
class Rotation:
    """A log file kept under `max_bytes`: when the next line would not fit, name.N-1 becomes
    name.N, ..., name becomes name.1, and the line starts a new file."""

    path: Path
    max_bytes: int
    backups: int
    size: int = 0  # bytes in the open file

    def open(self, truncate: bool) -> Channel:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        fd = os.open(self.path, flags, 0o644)
        self.size = os.fstat(fd).st_size
        return _fd_channel(fd)

    def is_due(self, line_bytes: int) -> bool:
        return self.size > 0 and self.size + line_bytes > self.max_bytes

    def rotate(self) -> Channel:
        """The new file's channel; the caller closes the old one (renaming an open file is
        fine), so a failure here leaves it usable."""
        backups = [self.path.with_name(f"{self.path.name}.{i}") for i in range(1, self.backups + 1)]
        for older, newer in reversed(list(itertools.pairwise([self.path, *backups]))):
            with contextlib.suppress(FileNotFoundError):  # fewer backups so far
                os.replace(older, newer)
        return self.open(truncate=True)  # with no backups, the file starts over


class LineSink:
    """What structlog writes to, one JSON line per call; a write never waits for the reader.

    Lines the channel does not take at once wait in `_pending`, whole and in order (its first
    line may be partly sent); each later write sends what the reader has room for first.
    When the pending lines would pass _PENDING_LIMIT the new line is dropped and counted."""

    def __init__(self, channel: Channel, rotation: Rotation | None) -> None:
        self._channel = channel
        self._rotation = rotation
        self._pending = bytearray()
        self._unreported = 0  # lines dropped since the last log.dropped line

    def write(self, line: bytes) -> None:
        self._send_pending()
        if self._unreported and not self._pending:  # the reader keeps up again
            count, self._unreported = self._unreported, 0
            self._add(_dropped_line(count))
        self._add(line)

    def flush(self) -> None:
        """Nothing to do: each write already sent what the reader had room for."""

    def close(self) -> None:
        self._send_pending()
        self._channel.close()

    def _rotate(self, rotation: Rotation) -> None:
        try:
            channel = rotation.rotate()
        except OSError:  # e.g. the directory is gone: keep appending, try after another max_bytes
            rotation.size = 0
            return
        self._channel.close()
        self._channel = channel

    def _add(self, line: bytes) -> None:
        global _lines_dropped
        if len(self._pending) + len(line) > _PENDING_LIMIT:
            _lines_dropped += 1
            self._unreported += 1
            return
        if self._rotation is not None and not self._pending and self._rotation.is_due(len(line)):
            self._rotate(self._rotation)  # only between lines: none is pending
        self._pending += line
        self._send_pending()

    def _send_pending(self) -> None:
        while self._pending:
            try:
                sent = self._channel.send(self._pending[: self._whole_lines_end()])
            except OSError:  # full (BlockingIOError), or gone: the lines wait, then drop
                return
            del self._pending[:sent]
            if self._rotation is not None:
                self._rotation.size += sent

    def _whole_lines_end(self) -> int:
        """The end of the whole lines in the first PIPE_BUF bytes (or of the first line, if
        longer): a pipe takes such a write entirely or not at all, so its reader never gets
        half a line, even if we exit, nor another writer's output inside one."""
        end = self._pending.rfind(b"\n", 0, select.PIPE_BUF) + 1
        return end or self._pending.find(b"\n") + 1


def _dropped_line(count: int) -> bytes:
    event = {"ts": time.time(), "level": "warning", "event": "log.dropped", "lines": count}
    return _orjson_dumps(event) + b"\n"
