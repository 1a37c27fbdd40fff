"""Structured output on a real server with the official openai client: `response_format`
json_schema answers parse and fit their schema, streamed or not, on both endpoints;
json_object answers are JSON objects; bad formats are 400s naming response_format; and a
constrained request leaves the greedy output of a free one beside it unchanged."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
MAX_TOKENS = 200

NAME = {"type": "string", "maxLength": 40}
PERSON = {
    "type": "object",
    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
}
CITY = {
    "type": "object",
    "properties": {
        "city": NAME,
        "country": NAME,
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
    },
    "required": ["city", "country", "population"],
}
CHOICE = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
    "required": ["color", "sure"],
}
LIST = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
    "required": ["items"],
}
NESTED = {
    "type": "object",
    "properties": {
        "book": {
            "type": "object",
            "properties": {
                "title": NAME,
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
            },
            "required": ["title", "year"],
        },
        "rating": {"enum": [1, 2, 3, 4, 5]},
    },
    "required": ["book", "rating"],
}
# (endpoint, prompt, schema): chat unless "completion"
CASES = [
    ("chat", "Describe a person you admire.", PERSON),
    ("chat", "Invent a character for a fairy tale.", PERSON),
    ("chat", "Who wrote Hamlet, and how old did he live to be?", PERSON),
    ("completion", "A short profile of a firefighter as JSON:\n", PERSON),
    ("chat", "Tell me about Paris.", CITY),
    ("chat", "Which city is the capital of Japan?", CITY),
    ("chat", "Describe a small town in Canada.", CITY),
    ("completion", "Facts about Berlin as JSON:\n", CITY),
    ("chat", "What colour is the sky on a clear day?", CHOICE),
    ("chat", "Pick the colour of grass.", CHOICE),
    ("chat", "What colour are strawberries?", CHOICE),
    ("completion", "My favourite colour, as JSON:\n", CHOICE),
    ("chat", "List three fruits.", LIST),
    ("chat", "Name some planets of the solar system.", LIST),
    ("chat", "What do I need to bake bread?", LIST),
    ("completion", "A shopping list as JSON:\n", LIST),
    ("chat", "Recommend a book.", NESTED),
    ("chat", "What is a classic science fiction novel?", NESTED),
    ("chat", "Review your favourite novel.", NESTED),
    ("completion", "A book review as JSON:\n", NESTED),
]


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def generate(
    server: RunningServer, endpoint: str, prompt: str, response_format: Any, stream: bool
) -> tuple[str, str | None]:
    """(text, finish_reason) of one greedy request; streamed deltas are joined."""
    client = client_for(server)
    common: dict[str, Any] = {"model": server.model, "temperature": 0, "max_tokens": MAX_TOKENS}
    common["extra_body"] = {"response_format": response_format}
    if endpoint == "chat":
        messages = [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(messages=messages, stream=stream, **common)
    else:
        reply = client.completions.create(prompt=prompt, stream=stream, **common)
    if not stream:
        choice = reply.choices[0]
        text = choice.message.content if endpoint == "chat" else choice.text
        return text, choice.finish_reason
    pieces, finish = [], None
    for chunk in reply:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        pieces.append((choice.delta.content if endpoint == "chat" else choice.text) or "")
        finish = choice.finish_reason or finish
    return "".join(pieces), finish


def test_json_schema_answers_parse_and_validate_streamed_or_not(
    cadence_server: RunningServer,
) -> None:
    jobs = [(case, stream) for case in CASES for stream in (False, True)]

    def run(job: tuple) -> tuple[str, str | None]:
        (endpoint, prompt, schema), stream = job
        return generate(cadence_server, endpoint, prompt, json_schema_format(schema), stream)

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(run, jobs))
    by_case: dict[str, list[str]] = {}
    for ((endpoint, prompt, schema), stream), (text, finish) in zip(jobs, answers, strict=True):
        print(f"{endpoint} stream={stream} {prompt!r}: {text!r}")
        assert finish == "stop", (prompt, text)
        jsonschema.validate(json.loads(text), schema)
        by_case.setdefault(prompt, []).append(text)
    assert all(whole == streamed for whole, streamed in by_case.values())  # greedy
    assert len({text for texts in by_case.values() for text in texts}) > 10  # varied answers


def test_json_object_answers_are_json_objects(cadence_server: RunningServer) -> None:
    # (this small model's chat answers ramble on in free-form JSON; completions end)
    prompts = [
        'A JSON object with the key "answer" for 2+2:\n',
        '{"question": "capital of Italy", "answer":',
        "The user record as JSON: ",
    ]

    def run(prompt: str) -> tuple[str, str | None]:
        return generate(cadence_server, "completion", prompt, {"type": "json_object"}, False)

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(run, prompts))
    for text, finish in answers:
        print(repr(text))
        assert finish == "stop" and isinstance(json.loads(text), dict)


def test_type_text_is_free_text(cadence_server: RunningServer) -> None:
    prompt = "Write one word."
    free = generate(cadence_server, "chat", prompt, None, stream=False)
    assert generate(cadence_server, "chat", prompt, {"type": "text"}, stream=False) == free


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (
            json_schema_format({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            "nonsense",
        ),
        (json_schema_format({"type": "array", "minItems": 3, "maxItems": 1}), "minItems"),
        (json_schema_format({"enum": []}), "enum"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "schema"),
        ({"type": "yaml"}, "type"),
        ("json_object", "type"),
        (json_schema_format({"enum": ["x" * 1000] * 70}), "bytes"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(
    cadence_server: RunningServer, response_format: Any, message: str
) -> None:
    client = client_for(cadence_server)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=cadence_server.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            extra_body={"response_format": response_format},
        )
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "response_format"
    assert message in error["message"]


def test_a_constrained_request_leaves_a_free_stream_beside_it_unchanged(
    cadence_server: RunningServer,
) -> None:
    client = client_for(cadence_server)
    body = {
        "model": cadence_server.model,
        "prompt": "Once upon a time, in a quiet village by the sea,",
        "temperature": 0,
        "max_tokens": 40,
        "extra_body": {"ignore_eos": True},
    }
    alone = client.completions.create(**body).choices[0].text
    with ThreadPoolExecutor(3) as pool:
        stream = iter(client.completions.create(stream=True, **body))
        beside = [next(stream).choices[0].text]  # it runs: now the constrained ones come
        constrained = [
            pool.submit(
                generate, cadence_server, endpoint, prompt, json_schema_format(schema), False
            )
            for endpoint, prompt, schema in CASES[::7]
        ]
        beside += [chunk.choices[0].text for chunk in stream if chunk.choices]
        for future in constrained:
            text, _ = future.result()
            json.loads(text)
    assert "".join(beside) == alone
