"""The official openai client against a real cadence server: chat and completions, both modes."""

from __future__ import annotations

import openai
import pytest

from gpu_worker.model_files import resolve_model
from service.tokenizer import Tokenizer
from tests import server_fixtures
from tests.server_fixtures import RunningServer, cache_dir

pytestmark = pytest.mark.real_model
cadence_server = server_fixtures.cadence_server
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(None, cache_dir()))


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_prompt_tokens(tokenizer: Tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_lists_the_served_model(cadence_server: RunningServer) -> None:
    models = client_for(cadence_server).models.list()
    assert [m.id for m in models.data] == [cadence_server.model]


def test_chat_greedy_answer_mentions_paris_with_exact_usage(
    cadence_server: RunningServer, tokenizer: Tokenizer
) -> None:
    reply = client_for(cadence_server).chat.completions.create(
        model=cadence_server.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        logprobs=True,
    )
    choice = reply.choices[0]
    print("chat answer:", repr(choice.message.content))
    assert "Paris" in choice.message.content
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert reply.usage.prompt_tokens == chat_prompt_tokens(tokenizer, QUESTION)
    assert reply.usage.completion_tokens == len(choice.logprobs.content)
    assert 0 < reply.usage.completion_tokens <= 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert choice.finish_reason == ("length" if reply.usage.completion_tokens == 24 else "stop")


def test_chat_stream_matches_the_whole_answer_and_reports_usage(
    cadence_server: RunningServer, tokenizer: Tokenizer
) -> None:
    client = client_for(cadence_server)
    whole = client.chat.completions.create(
        model=cadence_server.model, messages=QUESTION, temperature=0, max_tokens=24
    )
    chunks = list(
        client.chat.completions.create(
            model=cadence_server.model,
            messages=QUESTION,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_completion_greedy_and_streamed_agree_and_count_tokens(
    cadence_server: RunningServer, tokenizer: Tokenizer
) -> None:
    client = client_for(cadence_server)
    prompt = "The capital of France is"
    whole = client.completions.create(
        model=cadence_server.model, prompt=prompt, temperature=0, max_tokens=8
    )
    print("completion:", repr(whole.choices[0].text))
    assert "Paris" in whole.choices[0].text
    assert whole.object == "text_completion"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=True))
    chunks = list(
        client.completions.create(
            model=cadence_server.model,
            prompt=prompt,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(whole.choices[0].text) or whole.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8  # ignore_eos: exactly max_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompt_and_seeded_sampling_are_reproducible(
    cadence_server: RunningServer,
) -> None:
    client = client_for(cadence_server)
    ask = dict(
        model=cadence_server.model,
        prompt=[504, 3575, 282, 4649, 314],
        max_tokens=12,
        temperature=0.9,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    first, second = client.completions.create(**ask), client.completions.create(**ask)
    assert first.usage.prompt_tokens == 5 and first.usage.completion_tokens == 12
    assert first.choices[0].text == second.choices[0].text
