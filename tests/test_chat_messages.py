"""A chat's messages as its template takes them (service/chat_messages.py), without a model:
null content is text, and a template that knows no tools sees calls and results as text in
turns that still alternate; one that knows tools gets them as they are."""

from __future__ import annotations

import copy

from service.chat_messages import for_template

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
LOOP = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "one"},
    {"role": "tool", "tool_call_id": "c1", "content": None},
]
TOOL_TEMPLATE = "{% for m in messages %}{{ m.tool_calls if m.role != 'tool' }}{% endfor %}"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] + m['content'] }}{% endfor %}"


def test_a_template_that_knows_tools_gets_them_with_text_content() -> None:
    kept = copy.deepcopy(LOOP)
    shown = for_template(LOOP, TOOL_TEMPLATE)
    assert kept == LOOP  # the request's own messages are not changed
    assert [m["role"] for m in shown] == [m["role"] for m in LOOP]
    assert shown[2]["tool_calls"] == [CALL, CALL] and shown[2]["content"] == ""
    assert shown[4]["content"] == ""


def test_a_template_without_tools_sees_calls_and_results_as_alternating_text() -> None:
    shown = for_template(LOOP, PLAIN_TEMPLATE)
    assert [m["role"] for m in shown] == ["system", "user", "assistant", "user"]
    assert all(isinstance(m["content"], str) and "tool_calls" not in m for m in shown)
    block = '<tool_call>\n{"name":"f","arguments":{"x":1}}\n</tool_call>'
    assert shown[2]["content"] == f"{block}\n{block}"
    assert shown[3]["content"] == "<tool_response>\none\n</tool_response>\n" + (
        "<tool_response>\n\n</tool_response>"
    )


def test_a_result_after_a_user_turn_joins_it() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    shown = for_template(messages, PLAIN_TEMPLATE)
    assert shown == [{"role": "user", "content": "hi\n<tool_response>\nr\n</tool_response>"}]
    assert messages[0]["content"] == "hi"
