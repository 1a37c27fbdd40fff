"""A forgiving reader of JSON calls (`{"name": ..., "arguments": {...}}`) in a model's text,
which may stop anywhere: it says what the text holds so far without ever guessing ahead.

The arguments come back as the model wrote them (a slice of the text, not re-serialized),
so a call's arguments read from a longer text always extend those read from a shorter one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from service.tool_calls.parsed import CallText, bracket_end

WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and Mistral / Llama 3's names
_SCALAR_END = ",}] \t\r\n"


@dataclass(slots=True)
class ObjectScan:
    """A call object read from the text: its name and arguments once written; `end` the
    index after it (None: the text stops inside it); `broken` whether it stopped being
    JSON there."""

    name: str | None = None
    arguments: str | None = None
    end: int | None = None
    broken: bool = False

    def call(self) -> CallText | None:
        if self.name is None:
            return None
        arguments = self.arguments
        if arguments is None:  # none written: none yet, or none at all once it is closed
            arguments = "" if self.end is None else "{}"
        return CallText(self.name, arguments)


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
    """The index after the JSON string that opens at `pos` (None: not closed yet)."""
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == '"':
            return pos + 1
        pos += 1
    return None


def value_end(text: str, pos: int, final: bool) -> int | None:
    """The index after the JSON value that begins at `pos` (None: the text may continue it).
    Brackets are matched and strings skipped; what is inside is not checked."""
    opener = text[pos]
    if opener == '"':
        return string_end(text, pos)
    if opener not in "{[":
        while pos < len(text) and text[pos] not in _SCALAR_END:
            pos += 1
        return pos if pos < len(text) or final else None
    return bracket_end(text, pos, '"')


def scan_object(text: str, pos: int, final: bool) -> ObjectScan:
    """The call object opening (a `{`) at `pos`."""
    scan = ObjectScan()
    pos += 1
    while True:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return scan
        if text[pos] == "}":
            scan.end = pos + 1
            return scan
        if text[pos] == ",":
            pos += 1
            continue
        after = _scan_member(text, pos, final, scan)
        if after is None or scan.broken:
            return scan
        pos = after


def _scan_member(text: str, pos: int, final: bool, scan: ObjectScan) -> int | None:
    """Read one `"key": value` into `scan`; the index after it (None: the text stops)."""
    if text[pos] != '"':
        return _broken(scan, pos)
    key_end = string_end(text, pos)
    if key_end is None:
        return None
    key = json.loads(text[pos:key_end])
    pos = skip_whitespace(text, key_end)
    if pos < len(text) and text[pos] != ":":
        return _broken(scan, pos)
    pos = skip_whitespace(text, pos + 1)
    if pos >= len(text):
        return None
    end = value_end(text, pos, final)
    if key in ARGUMENT_KEYS and scan.arguments is None:
        scan.arguments = text[pos:end] if end is not None else text[pos:]
    elif key == "name" and end is not None and text[pos] == '"':
        scan.name = json.loads(text[pos:end])
    return end


def _broken(scan: ObjectScan, pos: int) -> int:
    scan.broken = True
    scan.end = pos
    return pos


def scan_calls(
    text: str, pos: int, final: bool, separator: str, closer: str | None = None
) -> tuple[list[CallText], int | None]:
    """Call objects from `pos` on, separated by `separator` (and ended by `closer`, if
    given): the calls, and the index where the text after them begins (None: the text may
    still continue the sequence). An object without a name ends the sequence before it."""
    calls: list[CallText] = []
    while True:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return calls, len(text) if final else None
        if text[pos] != "{":
            return calls, pos + 1 if text[pos] == closer else pos
        scan = scan_object(text, pos, final)
        call = scan.call()
        if call is None:
            return calls, pos if scan.end is not None or final else None
        calls.append(call)
        if scan.end is None:
            return calls, len(text) if final else None
        pos = skip_whitespace(text, scan.end)
        if pos < len(text) and text[pos] == separator:
            pos += 1
        elif pos >= len(text) and not final:
            return calls, None  # a separator may still come
        else:
            return calls, pos + 1 if pos < len(text) and text[pos] == closer else pos
