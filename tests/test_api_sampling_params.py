"""vLLM's sampling parameters and its grammars beyond JSON on a real server, through the
official openai client (extra_body), on the default model.

Token by token: stop_token_ids end the output at the token (its text left out), bad_words
keep a word's tokens out of it, min_tokens holds EOS back, logit_bias and allowed_token_ids
decide greedy choices, and the repetition penalty sees the prompt's and the generated
tokens (kept by the worker from step to step). Grammars under sampling (temperature 1,
several seeds): regex, choice, EBNF, JSON schema and structural tags, by each of the fields
that name them, and the output always matches. The requests of a test run concurrently.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer
from tests.server_fixtures import RunningServer, cache_dir

pytestmark = pytest.mark.real_model

CAPITAL = "The capital of France is"  # greedy: " Paris." and more
ONE_WORD = "Reply with one word: is the sky blue?"  # greedy: a short sentence, then EOS
ANIMALS = "A list of animals:"
MIN_TOKENS = 16


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(None, cache_dir()))


def token(tokenizer: Tokenizer, text: str) -> int:
    [found] = tokenizer.encode(text)
    return found


def run_all(jobs: dict[str, Any]) -> dict[str, Any]:
    """Each job's answer, the jobs run at once (so the server batches them)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def completion(server: RunningServer, prompt: str, max_tokens: int, **extra: Any):
    """A greedy completion's choice and usage, with its tokens (logprobs)."""
    client = client_for(server)
    reply = client.completions.create(
        model=server.model,
        prompt=prompt,
        temperature=0,
        max_tokens=max_tokens,
        logprobs=0,
        extra_body=extra,
    )
    return reply.choices[0], reply.usage


def chat(server: RunningServer, prompt: str, max_tokens: int, **extra: Any):
    client = client_for(server)
    reply = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=max_tokens,
        extra_body=extra,
    )
    return reply.choices[0], reply.usage


@pytest.fixture(scope="module")
def answers(cadence_server: RunningServer, tokenizer: Tokenizer) -> dict[str, Any]:
    s = cadence_server
    cat, dog, fox = (token(tokenizer, w) for w in (" cat", " dog", " fox"))
    listed = token(tokenizer, " animals")  # in the prompt: the repetition penalty sees it
    return run_all(
        {
            "free": lambda: completion(s, CAPITAL, 8),
            "stop_token": lambda: completion(
                s, CAPITAL, 12, stop_token_ids=[token(tokenizer, ".")]
            ),
            "bad_words": lambda: completion(s, CAPITAL, 8, bad_words=[" Paris"]),
            "short": lambda: chat(s, ONE_WORD, 24),
            "min_tokens": lambda: chat(s, ONE_WORD, 24, min_tokens=MIN_TOKENS),
            "biased": lambda: completion(s, ANIMALS, 5, logit_bias={str(cat): 100}),
            "repeating": lambda: completion(
                s,
                ANIMALS,
                3,
                allowed_token_ids=[listed, cat, dog, fox],
                repetition_penalty=10.0,
                logit_bias={str(t): 100 for t in (listed, cat, dog, fox)},
            ),
        }
    )


def test_a_stop_token_ends_the_output_before_its_text(answers):
    free, _ = answers["free"]
    cut = free.logprobs.tokens.index(".")  # the first "." of the free output
    choice, usage = answers["stop_token"]
    assert choice.text == "".join(free.logprobs.tokens[:cut]) and choice.finish_reason == "stop"
    assert usage.completion_tokens == cut + 1  # the stop token is generated, not shown


def test_bad_words_never_appear_among_the_tokens(answers):
    free, _ = answers["free"]
    assert free.logprobs.tokens[0] == " Paris"
    choice, _ = answers["bad_words"]
    assert not {" Paris", "Paris"} & set(choice.logprobs.tokens)


def test_min_tokens_holds_the_end_of_sequence_back(answers):
    short, short_usage = answers["short"]
    assert short.finish_reason == "stop" and short_usage.completion_tokens < MIN_TOKENS
    longer, usage = answers["min_tokens"]
    assert usage.completion_tokens >= MIN_TOKENS
    assert longer.message.content.startswith(short.message.content)


def test_logit_bias_and_allowed_tokens_decide_greedy_choices(answers):
    choice, _ = answers["biased"]
    assert choice.logprobs.tokens == [" cat"] * 5


def test_the_repetition_penalty_sees_the_prompt_and_each_generated_token(answers):
    # all four at ~100: one seen (in the prompt, or generated) falls to ~10
    choice, _ = answers["repeating"]
    assert sorted(choice.logprobs.tokens) == [" cat", " dog", " fox"]


# ---- grammars, under sampling ----------------------------------------------------------

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
COLOURS = ["red", "green", "blue", 'say "dark" \\ purple']
SUM_EBNF = 'root ::= num " + " num " = " num\nnum ::= [1-9] [0-9]?'
SUM = r"[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?"
SUM_LARK = "start: num ' + ' num \" = \" num\nnum: /[1-9]/ [/[0-9]/]  // vLLM takes Lark too"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
TAGGED = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<person>",
        "content": {"type": "json_schema", "json_schema": PERSON},
        "end": "</person>",
    },
}


def matches(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


def person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


def tagged_person(text: str) -> bool:
    found = re.fullmatch(r"<person>(.*)</person>", text, re.DOTALL)
    return found is not None and person(found.group(1))


# name -> (endpoint, prompt, extra_body, check, seeds): each kind by several seeds, each of
# its other fields by one
GRAMMARS = {
    "guided_regex": ("chat", "Give me a phone number.", {"guided_regex": PHONE}, matches(PHONE), 3),
    "structured_outputs.regex": (
        "completion",
        "Call us at",
        {"structured_outputs": {"regex": PHONE}},
        matches(PHONE),
        1,
    ),
    "structured_outputs.choice": (
        "chat",
        "Pick a colour.",
        {"structured_outputs": {"choice": COLOURS}},
        COLOURS.__contains__,
        3,
    ),
    "guided_choice": (
        "completion",
        "My favourite colour is",
        {"guided_choice": COLOURS},
        COLOURS.__contains__,
        1,
    ),
    "guided_grammar": ("chat", "Add two numbers.", {"guided_grammar": SUM_EBNF}, matches(SUM), 3),
    "structured_outputs.grammar": (
        "completion",
        "Arithmetic:",
        {"structured_outputs": {"grammar": SUM_EBNF}},
        matches(SUM),
        1,
    ),
    "guided_json": ("completion", "A person as JSON:\n", {"guided_json": PERSON}, person, 3),
    # SGLang's names for the same
    "regex": ("completion", "Call us at", {"regex": PHONE}, matches(PHONE), 1),
    "ebnf": ("chat", "Add two numbers.", {"ebnf": SUM_EBNF}, matches(SUM), 1),
    "guided_grammar.lark": (
        "completion",
        "Arithmetic:",
        {"guided_grammar": SUM_LARK},
        matches(SUM),
        1,
    ),
    "response_format.json_schema": (
        "chat",
        "Describe a person.",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            }
        },
        person,
        1,
    ),
    "response_format.structural_tag": (
        "chat",
        "Describe a person.",
        {"response_format": TAGGED},
        tagged_person,
        3,
    ),
}


def sampled(server: RunningServer, endpoint: str, prompt: str, extra: dict, seed: int):
    client = client_for(server)
    common: dict[str, Any] = {
        "model": server.model,
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 80,
        "extra_body": extra,
    }
    if endpoint == "chat":
        messages = [{"role": "user", "content": prompt}]
        choice = client.chat.completions.create(messages=messages, **common).choices[0]
        return choice.message.content, choice.finish_reason
    choice = client.completions.create(prompt=prompt, **common).choices[0]
    return choice.text, choice.finish_reason


@pytest.fixture(scope="module")
def grammar_answers(cadence_server: RunningServer) -> dict[tuple[str, int], tuple[str, str]]:
    return run_all(
        {
            (name, seed): lambda case=case, seed=seed: sampled(cadence_server, *case[:3], seed)
            for name, case in GRAMMARS.items()
            for seed in range(1, case[4] + 1)
        }
    )


@pytest.mark.parametrize("name", GRAMMARS)
def test_sampled_output_follows_its_grammar(grammar_answers, name):
    check, seeds = GRAMMARS[name][3:]
    outputs = [grammar_answers[name, seed] for seed in range(1, seeds + 1)]
    for text, finish in outputs:
        assert finish == "stop" and check(text), (text, finish)
    if seeds > 1 and name != "structured_outputs.choice":  # the seeds are seen: outputs differ
        assert len({text for text, _ in outputs}) > 1, outputs


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(("}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
            "response_format",
        ),
    ],
)
def test_a_grammar_the_compiler_rejects_is_a_400_naming_its_field(cadence_server, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client_for(cadence_server).completions.create(
            model=cadence_server.model, prompt="x", max_tokens=2, extra_body=extra
        )
    assert caught.value.status_code == 400 and caught.value.body["param"] == param
