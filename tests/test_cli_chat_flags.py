"""The chat flags of `cadence serve`: --chat-template takes a file or the Jinja text itself,
and the parsers' names are those registered."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import build_parser, config_from_args

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def serve_config(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_chat_template_is_a_file_or_inline_jinja(tmp_path: Path) -> None:
    file = tmp_path / "chat.jinja"
    file.write_text(TEMPLATE)
    assert serve_config("--chat-template", str(file)).chat_template == TEMPLATE
    assert serve_config("--chat-template", TEMPLATE).chat_template == TEMPLATE
    assert serve_config().chat_template is None
    with pytest.raises(SystemExit):
        serve_config("--chat-template", str(tmp_path / "missing.jinja"))


def test_parsers_are_chosen_by_name() -> None:
    config = serve_config(
        "--tool-call-parser",
        "pythonic",
        "--reasoning-parser",
        "qwen3",
        "--trust-request-chat-template",
        "--exclude-tools-when-tool-choice-none",
    )
    assert (config.tool_call_parser, config.reasoning_parser) == ("pythonic", "qwen3")
    assert config.trust_request_chat_template and config.exclude_tools_when_tool_choice_none
    assert serve_config().tool_call_parser is None
    with pytest.raises(SystemExit):
        serve_config("--tool-call-parser", "gpt-oss")
