"""Pythonic calls (Llama 3.2 and 4, ToolACE, some Qwen fine-tunes): a Python list of calls
with keyword arguments, `[get_weather(city="Paris"), get_time(zone="CET")]`.

A list is read once it is closed (its arguments are Python, turned into JSON only whole),
so each of its calls streams as one delta."""

from __future__ import annotations

import ast
import json
import re

from service.tool_calls.parsed import CallText, Parsed, bracket_end

# a list that opens with a call: `[name(`, the name possibly dotted
_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
# what may still grow into such a start, at the end of the text
_PARTIAL_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")
_QUOTES = "'\""


class PythonicParser:
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        pos = 0
        while True:
            found = _START.search(text, pos)
            if found is None:
                parsed.add_content(_content_tail(text[pos:], final))
                return parsed
            parsed.add_content(text[pos : found.start()])
            end = bracket_end(text, found.start(), _QUOTES)
            if end is None:
                if final:
                    parsed.add_content(text[found.start() :])
                return parsed
            calls = calls_of(text[found.start() : end])
            if calls is None:
                parsed.add_content(text[found.start() : end])
            else:
                parsed.calls += calls
            pos = end


def _content_tail(text: str, final: bool) -> str:
    partial = None if final else _PARTIAL_START.search(text)
    return text if partial is None else text[: partial.start()]


def calls_of(source: str) -> list[CallText] | None:
    """The calls of a list like `[f(a=1), g(b="x")]`; None if it is anything else."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = [_call_of(e) if isinstance(e, ast.Call) else None for e in tree.elts]
    return [call for call in calls if call is not None] if None not in calls else None


def _call_of(call: ast.Call) -> CallText | None:
    if call.args or any(k.arg is None for k in call.keywords):
        return None  # positional or **kwargs: not a call of a declared tool
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        return CallText(ast.unparse(call.func), json.dumps(arguments, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None  # a value that is not a literal (a name, an expression) or not JSON
