"""POST /v1/messages (Anthropic's Messages API) read as the chat request it amounts to, so that
it runs the chat's one engine path: `system` a system turn, `messages` the chat's messages
(`tool_use` blocks an assistant turn's tool calls, `tool_result` blocks tool messages),
`tools` and `tool_choice` the chat's function tools and choices, `stop_sequences` its stop,
`metadata.user_id` its `user` (the tenant hint), `thinking` the chat template's
enable_thinking, `output_config` its response_format and reasoning_effort.

Every field Anthropic's API accepts is translated or refused with a 400 naming it: what
needs Anthropic's own services (`container`, `mcp_servers`, server tools, workspaces, a
tier or speed other than the one there is), or content this text model cannot read
(images, documents). `cache_control` marks are accepted: the prefix cache keeps every
prompt's blocks already. `temperature`, `top_p`, `top_k` (which the newest SDKs send as
extra body fields) and fields of neither API go to the chat's parser as they are, so
vLLM's sampling extras are honoured alike (unknown ones logged). A thinking block sent
back is the model's own earlier reasoning: not shown again, as the Responses API leaves
reasoning items out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from service.api.errors import APIError, bad_request

# Chat Completions fields with an Anthropic name of their own, or none an answer could show
CHAT_ONLY = (
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "echo",
    "stream_options",
    "response_format",
    "max_completion_tokens",
    "stop",
    "user",
    "parallel_tool_calls",
    "include_reasoning",
    "reasoning_effort",
)
# field -> (the values that ask for nothing this server lacks, why the others are refused)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "service_tier": ((None, "auto", "standard_only"), "this server has one tier"),
    "speed": ((None, "standard"), "this server has one speed"),
    "container": ((None,), "this server runs no code containers"),
    "mcp_servers": ((None, []), "this server connects to no MCP servers"),
    "context_management": ((None,), "the context is sent whole; nothing is edited"),
    "output_format": ((None,), "send 'output_config.format'"),
    "inference_geo": ((None,), "this server runs where it runs"),
    "diagnostics": ((None,), "this server keeps no earlier prompts to compare"),
    "workspace_id": ((None,), "this server has no workspaces; its API keys name tenants"),
    "user_profile_id": ((None,), "the tenant is the API key's, and 'metadata.user_id' within it"),
}
# Read here; the chat's parser sees every other field as it is
OWN_FIELDS = frozenset(
    {"system", "messages", "tools", "tool_choice", "thinking", "stop_sequences", "metadata"}
    | {"cache_control", "output_config"}
    | set(NEUTRAL)
)
# count_tokens counts a prompt: a field of the generation is no part of it
COUNT_FIELDS = frozenset(
    {"model", "system", "messages", "tools", "tool_choice", "thinking", "cache_control"}
    | {"output_config"}  # its effort is the template's: it shapes the prompt
)
ANTHROPIC_FIELDS = {
    "stop": "stop_sequences",
    "user": "metadata",
    "response_format": "output_config",
    "reasoning_effort": "output_config",
}
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
THINKING_DISPLAYS = (None, "summarized", "omitted")  # summarized: as the model wrote it
EFFORTS = ("low", "medium", "high")  # the chat template's reasoning_effort
MIN_THINKING_BUDGET = 1024  # Anthropic's


@dataclass(slots=True)
class MessagesRequest:
    """A Messages body as the chat body that asks for the same."""

    chat: dict[str, Any]
    thinking: bool | None  # asked for (True), refused (False), or the template's default


def messages_request(body: Any, counting: bool = False) -> MessagesRequest:
    """`counting`: a count_tokens body, which names a prompt and no generation."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body, counting)
    if body.get("model") is None:
        raise bad_request("'model' is required", "model")
    chat = {name: value for name, value in body.items() if name not in OWN_FIELDS}
    chat["messages"] = system_of(body.get("system")) + messages_of(body.get("messages"))
    if body.get("tools") is not None:
        chat["tools"] = tools_of(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(tool_choice_of(body["tool_choice"]))
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    user = _user_of(body.get("metadata"))
    if user is not None:
        chat["user"] = user
    _check_cache_control(body.get("cache_control"))
    chat.update(output_config_of(body.get("output_config")))
    return MessagesRequest(chat, _add_thinking(body, chat))


def _add_thinking(body: dict[str, Any], chat: dict[str, Any]) -> bool | None:
    """The chat's options for `thinking`; whether it asks for thinking (None: not said)."""
    thinking = thinking_of(body.get("thinking"), body.get("max_tokens"), chat.get("tool_choice"))
    if thinking is None:
        return None
    kwargs = chat.get("chat_template_kwargs", {})
    if isinstance(kwargs, dict):  # else the chat's parser names the problem
        chat["chat_template_kwargs"] = {**kwargs, "enable_thinking": thinking}
    chat["include_reasoning"] = thinking and shows_thinking(body["thinking"])
    return thinking


def _check_fields(body: dict[str, Any], counting: bool) -> None:
    for name in CHAT_ONLY:
        if name in body:
            raise bad_request(f"'{name}' is a Chat Completions field, not a Messages one", name)
    for name, (allowed, why) in NEUTRAL.items():
        if body.get(name) not in allowed:
            raise bad_request(f"'{name}' is not supported: {why}", name)
    if counting:
        extra = sorted(set(body) - COUNT_FIELDS - set(NEUTRAL))
        if extra:
            raise bad_request(f"count_tokens counts a prompt; {extra} ask for a generation")
    elif body.get("max_tokens") is None:
        raise bad_request("'max_tokens' is required", "max_tokens")


def system_of(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    return [{"role": "system", "content": _text_of(value, "system")}]


def messages_of(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = message.get("role")
        if role == "user":
            messages += _user_turn(where, message.get("content"))
        elif role == "assistant":
            messages.append(_assistant_turn(where, message.get("content")))
        else:
            raise bad_request(
                f"{where}.role must be 'user' or 'assistant', got {role!r}", "messages"
            )
    return messages


def _blocks(where: str, content: Any) -> list[dict[str, Any]]:
    """A message's content blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where}.content must be a string or a list of blocks", "messages")
    return content


def _user_turn(where: str, content: Any) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages, its text as user messages, in order."""
    turn: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(where, content)):
        kind = block.get("type")
        if kind == "tool_result":
            turn.append(_tool_result(f"{where}.content[{i}]", block))
        elif kind == "text":
            text = _block_text(f"{where}.content[{i}]", block)
            if turn and turn[-1]["role"] == "user":
                turn[-1]["content"] += text
            else:
                turn.append({"role": "user", "content": text})
        else:
            raise _unsupported(f"{where}.content[{i}]", kind)
    return turn


def _tool_result(where: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}: a tool_result needs a string 'tool_use_id'", "messages")
    content = block.get("content", "")
    text = content if isinstance(content, str) else _text_of(content, "messages", where)
    if block.get("is_error"):
        text = f"Error: {text}"  # the template knows no error flag: the model reads it
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant_turn(where: str, content: Any) -> dict[str, Any]:
    text = ""
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(where, content)):
        kind, at = block.get("type"), f"{where}.content[{i}]"
        if kind == "text":
            text += _block_text(at, block)
        elif kind == "tool_use":
            calls.append(_tool_call(at, block))
        elif kind not in ("thinking", "redacted_thinking"):
            raise _unsupported(at, kind)
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_call(where: str, block: dict[str, Any]) -> dict[str, Any]:
    name, arguments = block.get("name"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise bad_request(f"{where}: a tool_use needs a 'name' and an object 'input'", "messages")
    function = {"name": name, "arguments": orjson.dumps(arguments).decode()}
    return {"id": block.get("id"), "type": "function", "function": function}


def _text_of(value: Any, param: str, where: str | None = None) -> str:
    """A string, or the text of a list of text blocks (system, a tool result's content)."""
    where = where or param
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of text blocks", param)
    texts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise _unsupported(f"{where}[{i}]", kind, param)
        texts.append(_block_text(f"{where}[{i}]", block, param))
    return "".join(texts)


def _block_text(where: str, block: dict[str, Any], param: str = "messages") -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}: a text block needs a string 'text'", param)
    if block.get("citations"):
        raise bad_request(f"{where}: citations are not supported", param)
    return text


def _unsupported(where: str, kind: Any, param: str = "messages") -> APIError:
    return bad_request(
        f"{where}: blocks of type {kind!r} are not supported (this server reads text, "
        "tool_use and tool_result blocks)",
        param,
    )


def tools_of(value: Any) -> list[dict[str, Any]]:
    """Anthropic's client tools as the chat's function tools; its server tools are a 400."""
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"tools[{i}]: tools of type {kind!r} are not supported (Anthropic runs those; "
                "declare a client tool with 'name' and 'input_schema')",
                "tools",
            )
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{i}] needs an object 'input_schema'", "tools")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def tool_choice_of(value: Any) -> dict[str, Any]:
    """The chat's `tool_choice` and `parallel_tool_calls` for Anthropic's `tool_choice`."""
    kind = value.get("type") if isinstance(value, dict) else None
    choices = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool" and isinstance(value.get("name"), str):
        choice: Any = {"type": "function", "function": {"name": value["name"]}}
    elif kind in choices:
        choice = choices[kind]
    else:
        raise bad_request(
            "'tool_choice' must be an object whose 'type' is 'auto', 'any', 'none', or 'tool' "
            "with a 'name'",
            "tool_choice",
        )
    parallel = value.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise bad_request(
            "'tool_choice.disable_parallel_tool_use' must be a boolean", "tool_choice"
        )
    return {"tool_choice": choice, "parallel_tool_calls": not parallel}


def _user_of(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise bad_request("'metadata' may only hold 'user_id'", "metadata")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad_request("'metadata.user_id' must be a string", "metadata")
    return user


def _check_cache_control(value: Any) -> None:
    """A cache breakpoint asks for what the prefix cache does for every prompt."""
    if value is not None and not (isinstance(value, dict) and value.get("type") == "ephemeral"):
        raise bad_request('\'cache_control\' must be {"type": "ephemeral"}', "cache_control")


def output_config_of(value: Any) -> dict[str, Any]:
    """`output_config`: its JSON schema format the chat's response_format (the grammar
    holds the answer to it), its effort the template's reasoning_effort."""
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - {"format", "effort"}:
        raise bad_request("'output_config' may hold 'format' and 'effort'", "output_config")
    chat: dict[str, Any] = {}
    given = value.get("format")
    if given is not None:
        if not isinstance(given, dict) or given.get("type") != "json_schema":
            message = '\'output_config.format\' must be {"type": "json_schema", "schema": ...}'
            raise bad_request(message, "output_config")
        spec = {"name": "output", "schema": given.get("schema")}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    effort = value.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(
                f"'output_config.effort' must be one of {list(EFFORTS)}", "output_config"
            )
        chat["reasoning_effort"] = effort
    return chat


def shows_thinking(value: dict[str, Any]) -> bool:
    display = value.get("display")
    if display not in THINKING_DISPLAYS:
        raise bad_request(
            f"'thinking.display' must be one of {list(THINKING_DISPLAYS)}", "thinking"
        )
    return display != "omitted"


def thinking_of(value: Any, max_tokens: Any, tool_choice: Any) -> bool | None:
    """Whether the model is asked to think; None: as its template does by default.

    `budget_tokens` is checked as Anthropic checks it; the thinking then runs within
    max_tokens, which bounds it and the answer together (Anthropic's budget is a target too)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in THINKING_TYPES:
        raise bad_request(f"'thinking.type' must be one of {list(THINKING_TYPES)}", "thinking")
    if kind == "disabled":
        return False
    if tool_choice == "required" or isinstance(tool_choice, dict):
        raise bad_request(
            "thinking may not be enabled when tool_choice forces tool use", "thinking"
        )
    budget = value.get("budget_tokens")
    if kind == "enabled" and not (
        isinstance(budget, int) and not isinstance(budget, bool) and budget >= MIN_THINKING_BUDGET
    ):
        raise bad_request(
            f"'thinking.budget_tokens' must be an integer of at least {MIN_THINKING_BUDGET}",
            "thinking",
        )
    if kind == "enabled" and isinstance(max_tokens, int) and budget >= max_tokens:
        raise bad_request("'thinking.budget_tokens' must be less than 'max_tokens'", "thinking")
    return True
