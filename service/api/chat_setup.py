"""What a chat needs beyond sampling, from its options and the server's flags: the chat
template's arguments, the grammar that forces its tool calls (tool_choice `required` or a
named function), and how its answer is read (reasoning, tool calls)."""

from __future__ import annotations

from typing import Any

import orjson

from service import reasoning
from service.api.chat_output import OutputReader
from service.api.errors import bad_request
from service.api.openai_chat import ChatOptions
from service.config import Config
from service.engine.grammar import ResponseFormat
from service.engine.grammar_reasoning import AfterReasoning
from service.tokenizer import Tokenizer
from service.tool_calls import parser_named
from service.tool_calls.forced import NamedParser, RequiredParser
from service.tool_calls.schema import named_schema, required_schema

PROMPT_TAIL_TOKENS = 8  # enough of the prompt's end to see whether it opened the reasoning


def template_args(chat: ChatOptions, config: Config) -> dict[str, Any]:
    """apply_chat_template's arguments beyond the messages."""
    if chat.template is not None and not config.trust_request_chat_template:
        raise bad_request(
            "this server does not accept a request's own chat template "
            "(it runs with the one it was started with)",
            "chat_template",
        )
    tools = chat.offered_tools(config.exclude_tools_when_tool_choice_none)
    return {**chat.template_kwargs, "tools": tools, "template": chat.template}


def check_tool_choice(chat: ChatOptions, config: Config) -> None:
    """vLLM's rule: `auto` (the default when tools are given) needs a parser to read calls."""
    if chat.tool_choice == "auto" and config.tool_call_parser is None:
        raise bad_request(
            '"auto" tool choice needs the server to run with --tool-call-parser; '
            'send tool_choice "required", a named function or "none"',
            "tool_choice",
        )


def forced_calls_format(chat: ChatOptions) -> ResponseFormat | None:
    """The JSON schema the answer must fit when the calls are forced; None otherwise."""
    functions = chat.functions()
    if chat.tool_choice == "required":
        schema = required_schema(functions, chat.parallel_tool_calls)
    elif chat.tool_choice == "function":
        schema = named_schema(next(f for f in functions if f["name"] == chat.function))
    else:
        return None
    return ResponseFormat("json_schema", orjson.dumps(schema).decode(), param="tools")


def output_reader(
    chat: ChatOptions, config: Config, tokenizer: Tokenizer, prompt_ids: list[int]
) -> OutputReader | None:
    """How the answer is read; None: as plain content."""
    reader = OutputReader(max_calls=None if chat.parallel_tool_calls else 1)
    if chat.tool_choice == "required":
        reader.tools = RequiredParser()
    elif chat.tool_choice == "function":
        assert chat.function is not None
        reader.tools = NamedParser(chat.function)
    elif chat.tool_choice == "auto" and config.tool_call_parser is not None:
        reader.tools = parser_named(config.tool_call_parser)
    forced = chat.tool_choice in ("required", "function")
    if config.reasoning_parser is not None and not forced:  # a grammar writes no reasoning
        tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        reader.reasons = True
        reader.starts_inside = reasoning.opens_reasoning(tail)
        reader.may_open = not reader.starts_inside and not reasoning.closes_reasoning(tail)
        reader.shows_reasoning = chat.include_reasoning
    if reader.tools is None and not reader.reasons:
        return None
    if reader.tools is not None and reader.tools.keeps_special_tokens:
        # the calls' markers are special tokens; the end-of-sequence ones are not content
        reader.dropped = tuple(tokenizer.pieces[i] for i in tokenizer.eos_token_ids)
    return reader


def keeps_special_tokens(reader: OutputReader | None) -> bool:
    return reader is not None and reader.tools is not None and reader.tools.keeps_special_tokens


def after_reasoning(
    grammar: Any, reader: OutputReader | None, chat: ChatOptions, tokenizer: Tokenizer
) -> Any:
    """`grammar` to begin once the reasoning ends (as vLLM starts it after the end marker),
    where the prompt opened the reasoning or the model may open it with its first token; as
    it is otherwise (no reasoning parser, a prompt that closed the reasoning, a start marker
    that is not one token). `thinking_token_budget` needs a grammar to end the reasoning
    into."""
    budget = chat.thinking_budget
    opener = None
    if reader is not None and reader.may_open:
        start = tokenizer.encode(reasoning.START)
        opener = start[0] if len(start) == 1 else None
    waits = reader is not None and (reader.starts_inside or opener is not None)
    if budget is not None and not (waits and grammar is not None):
        raise bad_request(
            "'thinking_token_budget' needs --reasoning-parser, a prompt after which the "
            "model reasons (a template that opens or lets it open <think>, e.g. "
            "chat_template_kwargs that enable thinking), and a grammar (response_format or "
            "a structured_outputs field) for the answer after it",
            "thinking_token_budget",
        )
    if grammar is None or not waits:
        return grammar
    end = tuple(tokenizer.encode(reasoning.END))
    return AfterReasoning(grammar, end, budget, opener)
