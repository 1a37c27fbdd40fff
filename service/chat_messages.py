"""A chat's messages as the chat template will take them.

Clients send what OpenAI's API allows: `content: null` on an assistant turn that only
called tools (every agent framework does), and tool results as `tool` turns. Templates are
written for what their model was trained on: SmolLM2's concatenates `message['content']`
(None fails it), Gemma 3's insists that user and model turns alternate and knows no `tool`
role. So, before any template renders them:

- a missing or null content is "" (vLLM does the same for templates that take text);
- a template that knows calls (its source reads `tool_calls`) gets them as they are, and
  one that knows results (it names the role "tool") gets the tool turns, to render its way;
- one that does not gets them as text it can show: each call as a Hermes `<tool_call>`
  block in the assistant's content, each result as a `<tool_response>` block in a user
  turn (results in a row, or after a user turn, join it), so turns still alternate.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

TOOL_ROLE = re.compile(r"""['"]tool['"]""")  # a template comparing a role with "tool"


def for_template(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """`messages` as the template of `source` takes them (new dicts; the input is kept)."""
    knows_calls = "tool_calls" in source
    knows_results = TOOL_ROLE.search(source) is not None
    shown: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool" and not knows_results:
            _add_result(shown, message)
        elif knows_calls:
            shown.append({**message, "content": message.get("content") or ""})
        else:
            shown.append(_as_text(message))
    return shown


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    text = message.get("content") or ""
    calls = [_call_block(call) for call in message.get("tool_calls") or ()]
    shown = {k: v for k, v in message.items() if k != "tool_calls"}
    shown["content"] = "\n".join([text, *calls] if text else calls)
    return shown


def _call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    payload = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{orjson.dumps(payload).decode()}\n</tool_call>"


def _add_result(shown: list[dict[str, Any]], message: dict[str, Any]) -> None:
    block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
    last = shown[-1] if shown else None
    if last is not None and last["role"] == "user":
        last["content"] = f"{last['content']}\n{block}" if last["content"] else block
    else:
        shown.append({"role": "user", "content": block})
