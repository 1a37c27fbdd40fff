"""What a tool-call parser returns, and the interface every parser has."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class CallText:
    """One call: the function's name and its arguments as JSON text (as far as written)."""

    name: str
    arguments: str


@dataclass(slots=True)
class Parsed:
    """A text split into what is shown as content and the calls it makes."""

    content: str = ""
    calls: list[CallText] = field(default_factory=list)

    def add_content(self, text: str) -> None:
        self.content += text


class ToolCallParser(Protocol):
    # the parser reads special tokens' text (`[TOOL_CALLS]`, `<|python_tag|>`), so the
    # output must be detokenized with them
    keeps_special_tokens: bool

    def parse(self, text: str, final: bool) -> Parsed:
        """`text`'s content and calls; with `final` False only what later text cannot change."""
        ...


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many of `text`'s last characters could begin one of `markers` (kept back from
    the content until the next text says whether they do)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def content_before(text: str, marker: str, final: bool) -> tuple[str, int | None]:
    """The content before `marker`'s first occurrence, and where the marker ends (None:
    absent; the content then stops short of a possible start of it, unless `final`)."""
    found = text.find(marker)
    if found >= 0:
        return text[:found], found + len(marker)
    keep = 0 if final else held_back(text, (marker,))
    return text[: len(text) - keep], None


def bracket_end(text: str, pos: int, quotes: str) -> int | None:
    """The index after the bracketed value that opens at `pos` (None: not closed yet):
    brackets are counted outside strings, which open and close with one of `quotes` and
    escape with a backslash. What is inside is not checked."""
    depth, quote = 0, None
    while pos < len(text):
        char = text[pos]
        if quote is not None:
            if char == "\\":
                pos += 1
            elif char == quote:
                quote = None
        elif char in quotes:
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return None
