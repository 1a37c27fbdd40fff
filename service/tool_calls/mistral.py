"""Mistral's calls: `[TOOL_CALLS]` (a special token) then a JSON array of
`{"name": ..., "arguments": {...}}` objects (Mistral 7B v0.3, Mixtral, Mistral Small / Nemo),
or, from the v11 tokenizer on (Mistral Small 3.1+, Devstral, Magistral), each call as
`[TOOL_CALLS]name[ARGS]{...}`."""

from __future__ import annotations

import re

from service.tool_calls.json_scan import scan_calls, skip_whitespace, value_end
from service.tool_calls.parsed import CallText, Parsed, content_before, held_back

START = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


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
            if pos < len(text) and text[pos] not in "[{":
                call, end = _named_call(text, pos, final)
                if call is not None:
                    parsed.calls.append(call)
                if end is None:
                    return parsed
                if call is None:
                    parsed.add_content(text[start:end])  # not a call after all
                pos = end
                continue
            if pos >= len(text):
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


def _named_call(text: str, pos: int, final: bool) -> tuple[CallText | None, int | None]:
    """The v11 form `name[ARGS]{...}` at `pos`: the call as far as written, and the index
    after it (None: the text may still continue it). Not that form: no call, and `pos`."""
    marker = text.find(ARGS, pos)
    if marker < 0:
        # the name, and perhaps the start of its [ARGS], may still be being written
        partial = len(text) - held_back(text, (ARGS,))
        if not final and _NAME.fullmatch(text, pos, partial):
            return None, None
        return None, pos
    if not _NAME.fullmatch(text, pos, marker):
        return None, pos
    name = text[pos:marker]
    args = skip_whitespace(text, marker + len(ARGS))
    if args >= len(text):
        return (None, pos) if final else (CallText(name, ""), None)
    if text[args] != "{":
        return None, pos
    end = value_end(text, args, final)
    return CallText(name, text[args : len(text) if end is None else end]), end
