"""Tool calls read out of a model's text: one parser per model family's wire format, chosen
by --tool-call-parser, each a pure function from the text so far to what it holds.

A parser's `parse(text, final)` returns the text's content and its calls. Called on a
growing text with final False it says only what no later text can change (a possible
start of a call is held back), so each result extends the one before: streamed deltas are
the differences between successive results, and the last one (final True) is the same as
parsing the whole text at once. That makes "streamed equals whole" hold by construction.
"""

from __future__ import annotations

from service.tool_calls.hermes import HermesParser
from service.tool_calls.llama3 import Llama3JsonParser
from service.tool_calls.mistral import MistralParser
from service.tool_calls.parsed import CallText, Parsed, ToolCallParser
from service.tool_calls.pythonic import PythonicParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}

__all__ = ["PARSERS", "CallText", "Parsed", "ToolCallParser", "parser_named"]


def parser_named(name: str) -> ToolCallParser:
    """The parser registered as `name` (KeyError if none is)."""
    return PARSERS[name]()
