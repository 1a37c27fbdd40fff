"""The Responses API's own options, as the chat fields that ask for the same, or a 400.

Each is honoured or refused, never dropped: `text.format` is the chat's response_format
(enforced by the grammar engine and reported back), `max_output_tokens` its max_tokens,
`reasoning.effort` its reasoning_effort, `top_logprobs` and `include` of
"message.output_text.logprobs" its logprobs (returned in the output_text parts),
`safety_identifier` the tenant (as the chat's `user`). What needs a server that keeps
responses (`store`, `background`, `previous_response_id`, `conversation`, a stored
`prompt`), truncates (`truncation: auto`), counts calls (`max_tool_calls`), routes by a
`prompt_cache_key`, or summarizes reasoning is refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from service.api.errors import bad_request

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# fields read here or by service.api.responses_input; the chat's parser sees every other
OWN_FIELDS = frozenset(
    {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "text",
        "reasoning",
        "top_logprobs",
        "include",
        "store",
        "background",
        "truncation",
        "max_tool_calls",
        "previous_response_id",
        "conversation",
        "prompt",
        "metadata",
        "prompt_cache_key",
        "safety_identifier",
    }
)
# field -> (the values that ask for nothing this server lacks, why the others are refused)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((None, False), "this server keeps no responses"),
    "background": ((None, False), "responses are served while the client waits"),
    "truncation": ((None, "disabled"), "an input longer than the context window is a 400"),
    "max_tool_calls": ((None,), "the calls of one answer are not counted; use parallel_tool_calls"),
    "previous_response_id": ((None,), "this server keeps no responses; send the whole input"),
    "conversation": ((None,), "this server keeps no conversations; send the whole input"),
    "prompt": ((None,), "this server keeps no prompt templates"),
    # requests share cached prefixes by their tokens, whatever key they carry
    "prompt_cache_key": ((None,), "the prefix cache is keyed by tokens, not by a key"),
}
TEXT_FORMATS = ("text", "json_object", "json_schema")
SUMMARIES = (None, "auto")  # auto: the reasoning itself, as the model wrote it


def chat_options_of(body: dict[str, Any]) -> dict[str, Any]:
    """The chat fields for the Responses options in `body`."""
    for name, (allowed, why) in NEUTRAL.items():
        if body.get(name) not in allowed:
            raise bad_request(f"'{name}' is not supported: {why}", name)
    chat: dict[str, Any] = {}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("safety_identifier") is not None and body.get("user") is None:
        chat["user"] = body["safety_identifier"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat | _logprobs(body.get("top_logprobs"), body.get("include"))


def text_format(body: dict[str, Any]) -> dict[str, Any]:
    """The `text.format` a response reports: the request's, or plain text."""
    text = body.get("text")
    given = text.get("format") if isinstance(text, dict) else None
    return given if isinstance(given, dict) else {"type": "text"}


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text`: {"format": {"type": ...}, "verbosity": ...} as the chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("'text' must be an object with a 'format'", "text")
    if text.get("verbosity") is not None:
        raise bad_request("'text.verbosity' is not supported by this model", "text")
    given = text.get("format")
    if given is None:
        return None
    kind = given.get("type") if isinstance(given, dict) else None
    if kind not in TEXT_FORMATS:
        message = f"'text.format' must be an object whose 'type' is one of {TEXT_FORMATS}"
        raise bad_request(message, "text")
    if kind != "json_schema":
        return {"type": kind}
    # Responses' json_schema format is flat; the chat's nests it under "json_schema"
    spec = {k: v for k, v in given.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def _reasoning_effort(reasoning: Any) -> Any:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object", "reasoning")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary not in SUMMARIES:
        raise bad_request(
            "'reasoning.summary' may only be 'auto': the reasoning is returned as written, "
            "not summarized",
            "reasoning",
        )
    return reasoning.get("effort")


def _logprobs(top: Any, include: Any) -> dict[str, Any]:
    """The chat's logprobs fields for `top_logprobs` and `include`."""
    if include is not None and (
        not isinstance(include, list) or any(item != LOGPROBS_INCLUDE for item in include)
    ):
        raise bad_request(f"'include' may only list {LOGPROBS_INCLUDE!r}", "include")
    if top is None and not include:
        return {}
    return {"logprobs": True, "top_logprobs": 0 if top is None else top}
