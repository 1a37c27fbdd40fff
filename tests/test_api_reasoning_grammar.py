"""A grammar that waits for the reasoning the model opens itself, on a real server with the
official openai client: a tiny random-weight Qwen3 served with Qwen3's own (hybrid) chat
template and `--reasoning-parser qwen3`.

That template ends its prompt with the assistant's turn and leaves `<think>` to the model;
a grammar that bound the first token forbade it, so the model could not think. Now the
first token may be the opener (`<think>`, one added token as in Qwen3's vocabulary) or one
the schema allows: after the opener the reasoning is free until `</think>` (forced here by a
thinking budget), and the schema binds the answer after it, whole and streamed,
`include_reasoning: false` leaving the reasoning out. With `enable_thinking: false` the
prompt closes the reasoning and the schema binds the first token: no `<think>` comes.

The model is random: its answer is whatever the schema lets it pick. A bias on `<think>`
makes it open the reasoning where it may (it outweighs the schema's tokens, not the whole
vocabulary): the reasoning holds tokens the schema never allows, the answer parses."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from tests.chat_stream_helpers import comparable, reassemble
from tests.server_fixtures import RunningServer, cache_dir, served
from tests.worker_fixtures import save_tiny_model

pytestmark = pytest.mark.real_model
TEMPLATE = Path(__file__).with_name("qwen3_template.jinja")
SMOLLM_DIR = cache_dir() / "models" / "SmolLM2-135M-Instruct"  # its tokenizer, and <think>s
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
BUDGET = 12
THINK_TAGS = ("<think>", "</think>")
OPENER_BIAS = 12  # ~ e^12 against the schema's few first tokens, not the 49,154 of all


def tiny_qwen3(path: Path) -> Path:
    """A random 2-layer Qwen3 with SmolLM2's vocabulary plus <think> and </think> (added
    tokens, not special ones, as in Qwen3's), its chat template Qwen3's own."""
    backend = RustTokenizer.from_file(str(SMOLLM_DIR / "tokenizer.json"))
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in THINK_TAGS])
    save_tiny_model(
        path,
        "qwen3",
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        max_position_embeddings=512,
    )
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((SMOLLM_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(SMOLLM_DIR / "generation_config.json", path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[RunningServer]:
    yield from served(
        tmp_path_factory,
        "qwen3-reasoning",
        *("--model", str(model), "--reasoning-parser", "qwen3"),
        # pinned: `auto` measures a new model's kernel candidates through its first
        # requests, seconds of CI for nothing this file claims
        *("--kernels", "attention=torch,layer_ops=torch,matmul=aten"),
    )


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def opener(model: Path) -> int:
    token = RustTokenizer.from_file(str(model / "tokenizer.json")).token_to_id("<think>")
    assert token is not None
    return token


def ask(server: RunningServer, opener: int, **extra: Any) -> dict:
    """The keyword arguments of a seeded chat whose answer must fit ANSWER."""
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": "Is the sky blue?"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER},
        },
        "max_tokens": 64,
        "temperature": 1.0,
        "seed": 3,
        "logit_bias": {str(opener): OPENER_BIAS},
        "extra_body": {"thinking_token_budget": BUDGET, **extra},
    }


def streamed(client: openai.OpenAI, fields: dict) -> dict:
    deltas = [
        chunk.choices[0].delta.model_dump(exclude_none=True)
        for chunk in client.chat.completions.create(stream=True, **fields)
        if chunk.choices
    ]
    return reassemble(deltas)


def test_the_model_opens_its_reasoning_and_the_schema_binds_the_answer_after_it(
    client: openai.OpenAI, server: RunningServer, opener: int
) -> None:
    fields = ask(server, opener)
    whole = client.chat.completions.create(**fields).choices[0].message
    thought = whole.model_extra["reasoning_content"]
    # free text, unlike the answer: the schema allows only blanks and then `{` first
    free = thought.replace("<think>", "").strip()
    assert free and not free.startswith("{"), thought
    jsonschema.validate(json.loads(whole.content), ANSWER)
    assert streamed(client, fields) == comparable(whole.model_dump())
    hidden_fields = ask(server, opener, include_reasoning=False)
    hidden = client.chat.completions.create(**hidden_fields).choices[0].message
    assert hidden.content == whole.content and not hidden.model_extra.get("reasoning_content")


def test_a_prompt_that_closed_the_reasoning_gets_the_schema_from_its_first_token(
    client: openai.OpenAI, server: RunningServer, opener: int
) -> None:
    fields = ask(server, opener, chat_template_kwargs={"enable_thinking": False})
    del fields["extra_body"]["thinking_token_budget"]  # no reasoning to bound
    whole = client.chat.completions.create(**fields).choices[0].message
    assert whole.model_extra["reasoning_content"] is None
    assert "<think>" not in whole.content  # the bias could not open it
    jsonschema.validate(json.loads(whole.content), ANSWER)
