"""The calls of a request whose tool_choice is `required` or names a function, written
under a grammar (service.tool_calls.schema) rather than in a model's own format, as vLLM
does: `required` writes a JSON array of `{"name": ..., "parameters": {...}}`, a named
function its arguments alone."""

from __future__ import annotations

from service.tool_calls.json_scan import scan_calls, skip_whitespace
from service.tool_calls.parsed import CallText, Parsed


class RequiredParser:
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_whitespace(text, 0)
        if pos >= len(text) or text[pos] != "[":
            return Parsed()  # the grammar allows nothing else: nothing yet
        calls, _ = scan_calls(text, pos + 1, final, ",", "]")
        return Parsed(calls=calls)


class NamedParser:
    keeps_special_tokens = False

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed(calls=[CallText(self.name, text.lstrip())])
