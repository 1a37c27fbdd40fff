"""Llama 3.1-3.3's JSON calls: `{"name": ..., "parameters": {...}}`, after `<|python_tag|>`
(a special token) or as the whole answer, several separated by `;`."""

from __future__ import annotations

from service.tool_calls.json_scan import scan_calls, skip_whitespace
from service.tool_calls.parsed import Parsed, content_before

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        first = skip_whitespace(text, 0)
        if first < len(text) and text[first] == "{":
            pos = first  # an answer that is only calls
        elif first >= len(text) and not final:
            return parsed  # blank so far: it may still open a call
        else:
            content, after = content_before(text, PYTHON_TAG, final)
            parsed.add_content(content)
            if after is None:
                return parsed
            pos = after
        calls, end = scan_calls(text, pos, final, ";")
        parsed.calls += calls
        if end is not None:
            parsed.add_content(text[end:] if calls else text[len(parsed.content) :])
        return parsed
