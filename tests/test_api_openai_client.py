"""The official openai client against a real cadence server: chat and completions, both modes."""

from __future__ import annotations

import openai
import pytest

from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer
from tests.server_fixtures import RunningServer, cache_dir

pytestmark = pytest.mark.real_model
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
    server_of_each_dtype: RunningServer, tokenizer: Tokenizer
) -> None:
    server = server_of_each_dtype
    reply = client_for(server).chat.completions.create(
        model=server.model,
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
    server_of_each_dtype: RunningServer, tokenizer: Tokenizer
) -> None:
    server = server_of_each_dtype
    client = client_for(server)
    whole = client.chat.completions.create(
        model=server.model, messages=QUESTION, temperature=0, max_tokens=24
    )
    chunks = list(
        client.chat.completions.create(
            model=server.model,
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
    server_of_each_dtype: RunningServer, tokenizer: Tokenizer
) -> None:
    server = server_of_each_dtype
    client = client_for(server)
    prompt = "The capital of France is"
    whole = client.completions.create(
        model=server.model,
        prompt=prompt,
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    print("completion:", repr(whole.choices[0].text))
    assert "Paris" in whole.choices[0].text
    assert whole.object == "text_completion"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=True))
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=prompt,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text  # the same greedy tokens, streamed or whole
    assert chunks[-1].usage.completion_tokens == 8  # ignore_eos: exactly max_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompt_and_seeded_sampling_are_reproducible(
    server_of_each_dtype: RunningServer,
) -> None:
    server = server_of_each_dtype
    client = client_for(server)
    ask = dict(
        model=server.model,
        prompt=[504, 3575, 282, 4649, 314],
        max_tokens=12,
        temperature=0.9,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    first, second = client.completions.create(**ask), client.completions.create(**ask)
    assert first.usage.prompt_tokens == 5 and first.usage.completion_tokens == 12
    assert first.choices[0].text == second.choices[0].text


def test_stop_strings_cut_the_real_output_streamed_and_whole(
    server_of_each_dtype: RunningServer,
) -> None:
    server = server_of_each_dtype
    client = client_for(server)
    ask = dict(model=server.model, prompt="The capital of France is", temperature=0, max_tokens=16)
    free = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
    print("unstopped:", repr(free))
    assert len(free.strip()) >= 12
    cases = [
        [free[:4]],  # matches at the very start of the output
        [free[6:9], free[2:4]],  # several: the earliest match wins, wherever it is listed
        [free[5:8]],  # begins and ends inside tokens
        [free[-3:] + "\u2603"],  # never completes: held-back text is released at the end
    ]
    for stop in cases:
        cut = min((i for s in stop if (i := free.find(s)) >= 0), default=-1)
        whole = client.completions.create(**ask, stop=stop, extra_body={"ignore_eos": True})
        chunks = list(
            client.completions.create(
                **ask, stop=stop, stream=True, extra_body={"ignore_eos": True}
            )
        )
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert whole.choices[0].text == streamed == (free[:cut] if cut >= 0 else free), stop
        assert whole.choices[0].finish_reason == finish == ("stop" if cut >= 0 else "length")
        # vLLM's stop_reason: the stop string that matched
        matched = min((s for s in stop if s in free), key=free.find, default=None)
        assert whole.choices[0].model_extra["stop_reason"] == matched
        if cut >= 0:
            assert whole.usage.completion_tokens < 16
