"""service.engine.grammar on the real SmolLM2 tokenizer: xgrammar's view of its vocabulary,
the compile cache, bad schemas, and a matcher walked through a hand-written JSON."""

from __future__ import annotations

import base64
import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import trio

from service.api import routes_openai
from service.engine.grammar import (
    GrammarCompiler,
    GrammarUnavailable,
    InvalidGrammar,
    Matcher,
    ResponseFormat,
    fill_masks,
    hf_tokenizer_info,
)
from service.engine.grammar_reasoning import AfterReasoning
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer
from tests.server_fixtures import cache_dir

pytestmark = pytest.mark.real_model
MODEL_VOCAB = 49152
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(None, cache_dir()))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(
        lambda: hf_tokenizer_info(tokenizer.backend, MODEL_VOCAB, tokenizer.eos_token_ids)
    )


def schema_format(schema: dict) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema))


def allowed(matcher: Matcher) -> set[int]:
    return tokens_of(fill_masks([matcher])[0])


def tokens_of(mask: str) -> set[int]:
    words = np.frombuffer(base64.b64decode(mask), dtype=np.uint8)
    return set(np.flatnonzero(np.unpackbits(words, bitorder="little")).tolist())


def test_the_vocabulary_is_byte_level_and_as_wide_as_the_model(tokenizer: Tokenizer) -> None:
    wider = MODEL_VOCAB + 64  # an embedding with more rows than the tokenizer has tokens
    info = hf_tokenizer_info(tokenizer.backend, wider, tokenizer.eos_token_ids)
    assert info.vocab_size == wider and info.vocab_type.name == "BYTE_LEVEL"
    assert not info.add_prefix_space
    assert sorted(info.stop_token_ids) == sorted(tokenizer.eos_token_ids)
    space_hello = tokenizer.encode(" hello")
    assert len(space_hello) == 1 and info.decoded_vocab[space_hello[0]] == b" hello"


def test_the_cache_returns_the_compiled_grammar_and_keeps_a_bounded_number(
    tokenizer: Tokenizer,
) -> None:
    compiler = GrammarCompiler(
        lambda: hf_tokenizer_info(tokenizer.backend, MODEL_VOCAB, tokenizer.eos_token_ids),
        max_cached=2,
    )
    person = compiler.compile(schema_format(PERSON))
    assert compiler.compile(schema_format(PERSON)) is person
    assert compiler.compile(ResponseFormat("json_object")) is not person
    # keys in another order: another grammar (the output follows the schema's order)
    reordered = {
        "required": PERSON["required"],
        "properties": PERSON["properties"],
        "type": "object",
    }
    assert compiler.compile(schema_format(reordered)) is not person
    assert compiler.compile(schema_format(PERSON)) is not person  # evicted: two kept


def test_the_cache_is_bounded_in_bytes(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    def info() -> object:
        return hf_tokenizer_info(tokenizer.backend, MODEL_VOCAB, tokenizer.eos_token_ids)

    person_bytes = compiler.compile(schema_format(PERSON)).memory_size_bytes
    object_bytes = compiler.compile(ResponseFormat("json_object")).memory_size_bytes
    bounded = GrammarCompiler(info, max_bytes=max(person_bytes, object_bytes))
    person = bounded.compile(schema_format(PERSON))
    assert bounded.compile(schema_format(PERSON)) is person
    assert bounded.cached_bytes == person_bytes
    bounded.compile(ResponseFormat("json_object"))  # both would exceed the bytes: evicts
    assert bounded.cached_bytes == object_bytes
    assert bounded.compile(schema_format(PERSON)) is not person
    tiny = GrammarCompiler(info, max_bytes=min(person_bytes, object_bytes) - 1)
    once = tiny.compile(schema_format(PERSON))
    assert tiny.compile(schema_format(PERSON)) is not once and tiny.cached_bytes == 0


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "nonsense"}}},
            'Unsupported type "nonsense"',
        ),
        ({"type": "array", "minItems": 5, "maxItems": 2}, "minItems is greater than maxItems"),
        ({"enum": []}, "enum array must not be empty"),
        ({"$ref": "#/$defs/missing"}, "missing"),
    ],
)
def test_a_schema_xgrammar_rejects_raises_with_its_reason(
    compiler: GrammarCompiler, schema: dict, message: str
) -> None:
    with pytest.raises(InvalidGrammar) as caught:
        compiler.compile(schema_format(schema))
    assert message in str(caught.value) and not str(caught.value).startswith("[")


def test_a_matcher_follows_a_valid_json_to_its_end_token(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    matcher = Matcher(compiler.compile(schema_format(PERSON)))
    eos = tokenizer.eos_token_ids
    for token in tokenizer.encode('{"name": "Bob", "age": 31}'):
        assert token in allowed(matcher)
        assert matcher.accept(token) and not matcher.is_terminated
    assert allowed(matcher) == set(eos)  # complete: only the end may follow
    assert not matcher.accept(tokenizer.encode("}")[0])  # refused, and nothing changes
    assert matcher.accept(eos[0]) and matcher.is_terminated


def test_a_matcher_refuses_what_the_schema_forbids(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    matcher = Matcher(compiler.compile(schema_format(PERSON)))
    for token in tokenizer.encode('{"name": "Bob", "age": '):
        assert matcher.accept(token)
    quote = tokenizer.encode('"')[0]
    assert quote not in allowed(matcher) and not matcher.accept(quote)
    assert matcher.accept(tokenizer.encode("7")[0])


def test_a_first_token_may_open_the_reasoning_before_the_grammar(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    """Where the model may open the reasoning (service.engine.grammar_reasoning): its first
    mask is the grammar's and the opener; the opener frees the reasoning until the end
    marker, then the grammar begins; a first token of the grammar's begins it at once."""
    compiled = compiler.compile(schema_format(PERSON))
    opener, end = 49000, (700, 33)  # ids standing for <think> and </think>
    first = allowed(Matcher(compiled))
    assert opener not in first

    def after_reasoning() -> Matcher:
        return Matcher(AfterReasoning(compiled, end, opener=opener))

    thinks = after_reasoning()
    assert thinks.needs_mask and allowed(thinks) == first | {opener}
    assert thinks.accept(opener) and thinks.mask is not None
    assert tokens_of(thinks.mask) >= set(range(MODEL_VOCAB))  # reasoning: any token
    assert all(thinks.accept(t) for t in (5, *end)) and not thinks.is_terminated
    assert thinks.needs_mask and allowed(thinks) == first  # the grammar from its start

    answers = after_reasoning()
    assert answers.accept(tokenizer.encode("{")[0])
    assert opener not in allowed(answers) and not answers.accept(opener)

    refused = after_reasoning()  # neither the grammar's nor the opener: nothing changes
    assert not refused.accept(tokenizer.encode('"')[0])
    assert allowed(refused) == first | {opener}


def test_without_xgrammar_a_compilation_says_it_is_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    compiler = GrammarCompiler(lambda: None)
    with pytest.raises(GrammarUnavailable, match=r"cadence\[structured\]"):
        compiler.compile(ResponseFormat("json_object"))


def accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, rf: ResponseFormat, text: str) -> bool:
    """Whether the grammar takes `text`'s tokens and then its end."""
    matcher = Matcher(compiler.compile(rf))
    taken = all(matcher.accept(t) for t in tokenizer.encode(text))
    return taken and matcher.accept(tokenizer.eos_token_ids[0]) and matcher.is_terminated


TAG_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
LEGACY_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f>", "schema": TAG_SCHEMA, "end": "</f>"}],
    "triggers": ["<f>"],
}
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<f>",
        "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
        "end": "</f>",
    },
}


@pytest.mark.parametrize(
    ("rf", "good", "bad"),
    [
        (ResponseFormat("regex", r"\d{3}-[a-z]+"), "123-abc", "12-abc"),
        (ResponseFormat("choice", json.dumps(['say "hi"', "a\\b", "new\nline"])), "a\\b", "a"),
        (
            ResponseFormat("choice", json.dumps(['say "hi"', "a\\b", "new\nline"])),
            "new\nline",
            "new",
        ),
        (ResponseFormat("grammar", 'root ::= "yes" | "no" [0-9]+'), "no42", "yes42"),
        (ResponseFormat("structural_tag", json.dumps(TAG)), '<f>{"a": 3}</f>', '<f>{"a": "x"}</f>'),
        (
            ResponseFormat("structural_tag", json.dumps(LEGACY_TAG)),
            'text <f>{"a": 3}</f> more',
            'text <f>{"b": 3}</f>',
        ),
    ],
)
def test_grammars_beyond_json_take_what_they_describe(compiler, tokenizer, rf, good, bad) -> None:
    assert accepts(compiler, tokenizer, rf, good)
    assert not accepts(compiler, tokenizer, rf, bad)


@pytest.mark.parametrize(
    "rf",
    [
        ResponseFormat("regex", "(("),
        ResponseFormat("grammar", "root ::= "),
        ResponseFormat("structural_tag", '{"type": "structural_tag", "format": {"type": "no"}}'),
        ResponseFormat("structural_tag", json.dumps({**LEGACY_TAG, "triggers": ["<g>"]})),
    ],
)
def test_a_grammar_xgrammar_rejects_is_invalid(compiler: GrammarCompiler, rf) -> None:
    with pytest.raises(InvalidGrammar):
        compiler.compile(rf)


async def test_the_compilers_slow_set_up_is_waited_for_outside_the_compile_timeout(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine the vocabulary's conversion alone can outlast the timeout: the
    first request with a grammar waits for it instead of getting a 400."""

    def slow_info():
        time.sleep(0.5)
        return hf_tokenizer_info(tokenizer.backend, MODEL_VOCAB, tokenizer.eos_token_ids)

    monkeypatch.setattr(routes_openai, "GRAMMAR_COMPILE_TIMEOUT_S", 0.3)
    state = SimpleNamespace(
        grammars=GrammarCompiler(slow_info), grammar_threads=trio.CapacityLimiter(1)
    )
    compiled = await routes_openai.grammar_of(ResponseFormat("json_object"), state)  # type: ignore[arg-type]
    assert Matcher(compiled).needs_mask
