"""Hermes-style calls (Qwen2.5 and Qwen3, Hermes 2/3, many fine-tunes): each call is a JSON
object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, with
content before, between and after them."""

from __future__ import annotations

from service.tool_calls.json_scan import scan_object, skip_whitespace
from service.tool_calls.parsed import Parsed, content_before

START = "<tool_call>"
END = "</tool_call>"


class HermesParser:
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        pos: int | None = 0
        while pos is not None:
            content, after = content_before(text[pos:], START, final)
            parsed.add_content(content)
            if after is None:
                break
            pos = _read_block(text, pos + len(content), pos + after, final, parsed)
        return parsed


def _read_block(text: str, start: int, body: int, final: bool, parsed: Parsed) -> int | None:
    """Read the block whose tag opens at `start` (its body at `body`) into `parsed`; where
    the text after it begins (None: the text ends inside it). The object's own brackets
    end it, so a closing tag written inside its strings is text."""
    pos = skip_whitespace(text, body)
    scan = scan_object(text, pos, final) if pos < len(text) and text[pos] == "{" else None
    call = None if scan is None else scan.call()
    if call is not None:
        parsed.calls.append(call)
    if scan is not None and scan.end is None:
        return None  # the object goes on
    closing = text.find(END, body if scan is None else scan.end)
    if call is None and (closing >= 0 or final):  # no call after all: the block is content
        parsed.add_content(text[start : closing + len(END) if closing >= 0 else len(text)])
    return closing + len(END) if closing >= 0 else None
