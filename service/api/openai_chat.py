"""A chat request's conversation and its tools, read from JSON: the messages (tool results
and assistant turns that called tools included), `tools`, `tool_choice`,
`parallel_tool_calls` and what goes to the chat template (`chat_template`,
`chat_template_kwargs`, `reasoning_effort`). Problems are 400s naming the field.

The messages reach the template as transformers' `apply_chat_template` gets them, with one
change vLLM makes too: a call's `arguments` (JSON text on the wire) becomes the object it
encodes, which is what templates write out with `tojson`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from service.api.errors import bad_request

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# names the server itself gives the template: a request's kwargs may not replace them
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


@dataclass(slots=True)
class ChatOptions:
    """The tools a chat offers and how its template is rendered."""

    tools: list[dict[str, Any]] | None = None  # as sent: {"type": "function", "function": ...}
    tool_choice: str = "none"  # "none" | "auto" | "required" | "function" (then `function`)
    function: str | None = None  # the named function of tool_choice
    parallel_tool_calls: bool = True
    template: str | None = None  # the request's own chat template
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content from the answer
    thinking_budget: int | None = None  # vLLM's thinking_token_budget: reasoning tokens at most

    def functions(self) -> list[dict[str, Any]]:
        """The declared functions ({"name", "parameters", ...})."""
        return [tool["function"] for tool in self.tools or ()]

    def offered_tools(self, exclude_when_none: bool) -> list[dict[str, Any]] | None:
        """What the template gets as `tools`: with tool_choice none, vLLM still shows them
        unless told not to (--exclude-tools-when-tool-choice-none)."""
        if self.tool_choice == "none" and exclude_when_none:
            return None
        return self.tools


def parse_chat_options(raw: Any) -> ChatOptions:
    """`raw(name)` reads a body field (and marks it used)."""
    tools = _parse_tools(raw("tools"))
    tool_choice, function = _parse_tool_choice(raw("tool_choice"), tools)
    parallel = raw("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    kwargs = _parse_template_kwargs(raw("chat_template_kwargs"))
    effort = raw("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"'reasoning_effort' must be one of {list(REASONING_EFFORTS)}", "reasoning_effort"
            )
        kwargs.setdefault("reasoning_effort", effort)  # as vLLM: the template's variable
    template = raw("chat_template")
    if template is not None and (not isinstance(template, str) or not template):
        raise bad_request("'chat_template' must be a non-empty string", "chat_template")
    include_reasoning = raw("include_reasoning")
    if include_reasoning is not None and not isinstance(include_reasoning, bool):
        raise bad_request("'include_reasoning' must be true or false", "include_reasoning")
    return ChatOptions(
        tools,
        tool_choice,
        function,
        parallel is not False,
        template,
        kwargs,
        include_reasoning is not False,
    )


def _parse_tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        name = _check_tool(i, tool)
        if name in names:
            raise bad_request(f"tools[{i}]: the function name {name!r} is declared twice", "tools")
        names.add(name)
    return value or None


def _check_tool(index: int, tool: Any) -> str:
    param = "tools"
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"{where} must be an object whose 'type' is 'function'", param)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", param)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name must be a non-empty string", param)
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", param)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", param)
    return name


def _parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    param = "tool_choice"
    if value is None:
        return ("auto" if tools else "none"), None  # OpenAI's defaults
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                "'tool_choice' must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param,
            )
        declared = [tool["function"]["name"] for tool in tools or ()]
        if name not in declared:
            raise bad_request(
                f"tool_choice names the function {name!r}, which 'tools' does not declare",
                param,
            )
        return "function", name
    if value not in TOOL_CHOICES:
        raise bad_request(f"'tool_choice' must be one of {list(TOOL_CHOICES)} or a function", param)
    if value == "required" and not tools:
        raise bad_request("tool_choice 'required' needs 'tools'", param)
    return value, None


def _parse_template_kwargs(value: Any) -> dict[str, Any]:
    param = "chat_template_kwargs"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'chat_template_kwargs' must be an object", param)
    reserved = sorted(RESERVED_TEMPLATE_NAMES & set(value))
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {reserved}", param)
    return dict(value)


def parse_message(index: int, message: Any) -> dict[str, Any]:
    """One message, as the template gets it."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{param}.role must be one of {list(CHAT_ROLES)}, got {role!r}", param)
    calls = message.get("tool_calls") if role == "assistant" else None
    content = _content(param, message.get("content"), optional=bool(calls))
    # The template decides how a developer message is shown; most know only "system".
    parsed: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if calls:
        parsed["tool_calls"] = _tool_calls(param, calls)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{param}: a tool message needs a string 'tool_call_id'", param)
        parsed["tool_call_id"] = call_id
    name = message.get("name")
    if isinstance(name, str):
        parsed["name"] = name
    return parsed


def _content(param: str, content: Any, optional: bool) -> str | None:
    if content is None and optional:
        return None  # an assistant turn that only called tools
    if isinstance(content, list):
        content = "".join(_text_of_part(param, part) for part in content)
    if not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or a list of text parts", param)
    return content


def _text_of_part(param: str, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise bad_request(f"{param}.content: only text parts are supported", param)
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{param}.content: a text part needs a string 'text'", param)
    return text


def _tool_calls(param: str, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"{param}.tool_calls must be a list", param)
    return [_tool_call(f"{param}.tool_calls[{i}]", call) for i, call in enumerate(calls)]


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{where} must be an object with a 'function' that has a 'name'", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            raise bad_request(f"{where}.function.arguments must be JSON text", where) from None
    parsed = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        parsed["id"] = call["id"]
    return parsed
