"""The JSON schemas that make the grammar engine write only valid calls: for tool_choice
`required`, an array of calls of the declared tools (each its own parameters' schema); for
a named function, that function's parameters."""

from __future__ import annotations

from typing import Any

# a function declared without parameters takes an object of any members
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """At least one call (exactly one unless `parallel`), each of one declared tool."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["name"]]},
                "parameters": tool.get("parameters") or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("parameters") or ANY_OBJECT
