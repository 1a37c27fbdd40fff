"""Which grammar a request's output must follow, from whichever field names it.

OpenAI's `response_format` (json_object, json_schema; xgrammar's structural_tag too, as
vLLM takes it), vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
"json_object" | "structural_tag": ...}, vLLM >= 0.10), and its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`, and SGLang's `regex`, `ebnf` and
`json_schema`. At most one may be given (as vLLM).
Types and sizes are read here; whether xgrammar compiles it is the grammar compiler's
question (service.engine.grammar), answered with a 400 naming the same field.
"""

from __future__ import annotations

from typing import Any

import orjson

from service.api.errors import bad_request
from service.api.fields import Fields
from service.api.lark_grammar import LarkError, is_lark, lark_to_ebnf
from service.engine.grammar import ResponseFormat

MAX_GRAMMAR_BYTES = 64 * 1024  # a schema serialized, a regex, a grammar, a structural tag
MAX_CHOICES = 1024
# vLLM's structured_outputs options that only tune a constraint: accepted at their neutral
# value (this server always allows any whitespace, as vLLM's default)
NEUTRAL_OPTIONS = (
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    # SGLang's names
    "regex": "regex",
    "ebnf": "grammar",
    "json_schema": "json",
}


def parse_grammar(fields: Fields, response_format: ResponseFormat | None) -> ResponseFormat | None:
    """The one grammar the request asks for (`response_format` read already), or None."""
    found = [response_format] if response_format is not None else []
    found += _structured_outputs(fields.raw("structured_outputs"))
    for name, kind in GUIDED.items():
        value = fields.raw(name)
        if value is not None:
            found.append(_constraint(kind, value, name))
    if len(found) > 1:
        names = ", ".join(f.param for f in found)
        raise bad_request(
            f"only one kind of structured output may be given, got {names}", found[1].param
        )
    return found[0] if found else None


def structural_tag_format(value: dict[str, Any], param: str = "response_format") -> ResponseFormat:
    """vLLM's response_format of type structural_tag, legacy ("structures" and "triggers")
    or xgrammar's ("format"), as the JSON the compiler takes."""
    legacy = isinstance(value.get("structures"), list) and isinstance(value.get("triggers"), list)
    if not legacy and not isinstance(value.get("format"), dict):
        raise bad_request(
            f"'{param}' of type structural_tag needs 'structures' and 'triggers', or a 'format'",
            param,
        )
    if legacy and not all(
        isinstance(s, dict)
        and isinstance(s.get("begin"), str)
        and isinstance(s.get("end"), str)
        and "schema" in s
        for s in value["structures"]
    ):
        raise bad_request(f"each of '{param}.structures' needs 'begin', 'schema' and 'end'", param)
    return ResponseFormat("structural_tag", _bounded(_json_text(value, param), param), param)


def _structured_outputs(value: Any) -> list[ResponseFormat]:
    param = "structured_outputs"
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object", param)
    for option in NEUTRAL_OPTIONS:
        if value.get(option) not in (None, False):
            raise bad_request(f"'{param}.{option}' is not supported by this server", param)
    unknown = set(value) - {*_KINDS, *NEUTRAL_OPTIONS}
    if unknown:
        raise bad_request(f"unknown {param} fields {sorted(unknown)}", param)
    return [
        _constraint(kind, value[kind], param)
        for kind in _KINDS
        if value.get(kind) not in (None, False)
    ]


def _constraint(kind: str, value: Any, param: str) -> ResponseFormat:
    return _KINDS[kind](value, param)


def _json(value: Any, param: str) -> ResponseFormat:
    schema = _json_object_of(value, f"'{param}' must be a JSON schema", param)
    return ResponseFormat("json_schema", _bounded(_json_text(schema, param), param), param)


def _json_object(value: Any, param: str) -> ResponseFormat:
    if value is not True:
        raise bad_request(f"'{param}.json_object' must be true", param)
    return ResponseFormat("json_object", None, param)


def _text(kind: str) -> Any:
    def parse(value: Any, param: str) -> ResponseFormat:
        if not isinstance(value, str) or not value:
            raise bad_request(f"'{param}' must be a non-empty string ({kind})", param)
        return ResponseFormat(kind, _bounded(value, param), param)

    return parse


def _grammar(value: Any, param: str) -> ResponseFormat:
    """xgrammar's EBNF, or a Lark grammar converted to it (as vLLM's xgrammar backend)."""
    grammar = _text("grammar")(value, param)
    assert grammar.schema is not None
    if not is_lark(grammar.schema):
        return grammar
    try:
        return ResponseFormat("grammar", _bounded(lark_to_ebnf(grammar.schema), param), param)
    except LarkError as exc:
        raise bad_request(f"'{param}' (a Lark grammar): {exc}", param) from None


def _choice(value: Any, param: str) -> ResponseFormat:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"'{param}' must be a non-empty list of non-empty strings", param)
    if len(value) > MAX_CHOICES:
        raise bad_request(f"'{param}' may offer at most {MAX_CHOICES} choices", param)
    return ResponseFormat("choice", _bounded(_json_text(value, param), param), param)


def _structural_tag(value: Any, param: str) -> ResponseFormat:
    tag = _json_object_of(value, f"'{param}.structural_tag' must be a JSON object", param)
    return structural_tag_format(tag, param)


def _json_object_of(value: Any, error: str, param: str) -> dict[str, Any]:
    """A JSON object given as itself or as its text."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise bad_request(error, param) from None
    if not isinstance(value, dict):
        raise bad_request(error, param)
    return value


_KINDS = {
    "json": _json,
    "regex": _text("regex"),
    "choice": _choice,
    "grammar": _grammar,
    "json_object": _json_object,
    "structural_tag": _structural_tag,
}


def _json_text(value: Any, param: str) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:  # deeper than orjson writes (it reads deeper)
        raise bad_request(f"'{param}' is nested too deeply", param) from None


def _bounded(text: str, param: str) -> str:
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise bad_request(
            f"'{param}' is {size} bytes, more than the {MAX_GRAMMAR_BYTES} allowed", param
        )
    return text
