"""Mistral's calls (Mistral 7B v0.3, Mixtral, Mistral Small / Nemo): `[TOOL_CALLS]` (a
special token) then a JSON array of `{"name": ..., "arguments": {...}}` objects."""

from __future__ import annotations

from service.tool_calls.json_scan import scan_calls, skip_whitespace
from service.tool_calls.parsed import Parsed, content_before

START = "[TOOL_CALLS]"


class MistralParser:
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        pos = 0
        while True:
            content, after = content_before(text[pos:], START, final)
            parsed.add_content(content)
            if after is None:
                return parsed
            start, pos = pos + len(content), skip_whitespace(text, pos + after)
            if pos >= len(text) and not final:
                return parsed  # the array has not begun yet
            if pos >= len(text) or text[pos] not in "[{":
                parsed.add_content(text[start:pos])  # not a call after all
                continue
            # a single object without the array: some fine-tunes write it so
            opened = text[pos] == "["
            calls, end = scan_calls(text, pos + opened, final, ",", "]" if opened else None)
            if not calls and end is not None:
                parsed.add_content(text[start:end])
            parsed.calls += calls
            if end is None:
                return parsed
            pos = end
