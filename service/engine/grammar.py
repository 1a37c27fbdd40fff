"""Grammars for constrained decoding (`response_format`, vLLM's `structured_outputs`), through
xgrammar: JSON (any object, or a schema), a regex, a choice among strings, an EBNF grammar,
or a structural tag.

A request's grammar is compiled once (off the event loop, cached) into a grammar over
the model's token vocabulary. Each constrained request then holds a Matcher: before a step
samples its token, its `mask` must hold which tokens the grammar allows next as a bitmask,
which travels in the plan to the worker's sampler; after the step, it accepts the token
drawn, which empties the mask. Masks are filled by `fill_masks`, many at once and off the
event loop (service.engine.masks). A grammar ends by accepting an end-of-sequence token,
which finishes the request.

xgrammar is optional (the `structured` extra) and imported only when a grammar is needed.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from service.engine.grammar_reasoning import AfterReasoning, ReasoningPhase

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RustTokenizer

MAX_CACHED_GRAMMARS = 256
# xgrammar's compiled grammars of 64 KiB schemas reach megabytes: bound the cache in bytes
MAX_CACHED_GRAMMAR_BYTES = 256 * 1024 * 1024
# vLLM lets any whitespace run between JSON tokens; unbounded, a small model fills
# max_tokens with blank lines (SmolLM2-135M does, after "age":). 8 still fits an indent.
MAX_WHITESPACE = 8
# vLLM's json_object: an object (a bare array or string is JSON too, but not what is asked).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar prefixes its C++ errors with a time and a source location
_ERROR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
# the cores this process may run on: xgrammar's batch fill spreads rows over threads
CORES = len(os.sched_getaffinity(0))


class GrammarUnavailable(Exception):
    """xgrammar is not installed: structured output cannot be served (HTTP 400)."""


class InvalidGrammar(ValueError):
    """The schema cannot be compiled into a grammar; the message says why (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What the output must be, by `type`: any JSON object ("json_object"); JSON matching
    `schema` ("json_schema": the schema as JSON text, its keys in the request's order, which
    is the order the output's properties follow); text matching the regex `schema`
    ("regex"); one of the strings of the JSON list `schema` ("choice"); text of the EBNF
    grammar `schema`, from its rule `root` ("grammar"); or xgrammar's structural tag, the
    JSON object `schema` ("structural_tag"). `param` is the request field it came from."""

    type: str
    schema: str | None = None
    param: str = field(default="response_format", compare=False)

    @property
    def kind(self) -> str:
        """What it is, in words (for messages)."""
        return _KIND_NAMES.get(self.type, self.type.replace("_", " "))


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarUnavailable(
            "structured output (response_format) needs xgrammar on the server: "
            "pip install 'cadence[structured]'"
        ) from exc
    return xgrammar


def hf_tokenizer_info(backend: RustTokenizer, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of a tokenizer.json vocabulary (without transformers' tokenizer).

    `vocab_size` is the model's: its embedding may have more rows than the tokenizer has
    tokens, and those ids must be masked too (as empty tokens, never allowed)."""
    xgr = _xgrammar()
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        [backend.id_to_token(i) or "" for i in range(vocab_size)],
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=metadata["add_prefix_space"],
    )


class GrammarCompiler:
    """Compiles response formats, keeping the last MAX_CACHED_GRAMMARS compiled, at most
    `max_bytes` of them together (xgrammar's own measure of each).

    Blocking (run it in a thread) and thread-safe. xgrammar's own cache is off: it has no
    bound on entries. `tokenizer_info` is called once, at the first compilation, so that
    neither xgrammar's import nor the vocabulary's conversion costs anything until a
    request asks for structured output.
    """

    def __init__(
        self,
        tokenizer_info: Callable[[], Any],
        max_cached: int = MAX_CACHED_GRAMMARS,
        max_bytes: int = MAX_CACHED_GRAMMAR_BYTES,
    ) -> None:
        self._tokenizer_info = tokenizer_info
        self._max_cached = max_cached
        self._max_bytes = max_bytes
        self._bytes = 0
        self._compiler: Any = None
        self._cache: collections.OrderedDict[ResponseFormat, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def is_prepared(self) -> bool:
        return self._compiler is not None

    def prepare(self) -> None:
        """Imports xgrammar and converts the vocabulary, once (seconds: blocking, call it in
        a thread); raises GrammarUnavailable."""
        with self._lock:
            if self._compiler is None:
                self._compiler = _xgrammar().GrammarCompiler(
                    self._tokenizer_info(), max_threads=1, cache_enabled=False
                )

    def compile(self, response_format: ResponseFormat) -> Any:
        """The xgrammar CompiledGrammar; raises GrammarUnavailable or InvalidGrammar."""
        self.prepare()
        with self._lock:
            compiled = self._cache.get(response_format)
            if compiled is not None:
                self._cache.move_to_end(response_format)
                return compiled
        compiled = self._compile(response_format)
        with self._lock:
            self._keep(response_format, compiled)
        return compiled

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def _keep(self, response_format: ResponseFormat, compiled: Any) -> None:
        size = compiled.memory_size_bytes
        if size > self._max_bytes or response_format in self._cache:
            return  # too large to keep; or a concurrent compilation kept it first
        self._cache[response_format] = compiled
        self._bytes += size
        while len(self._cache) > self._max_cached or self._bytes > self._max_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._bytes -= evicted.memory_size_bytes

    def _compile(self, response_format: ResponseFormat) -> Any:
        compile_as = _COMPILE[response_format.type]
        try:
            compiled = compile_as(self._compiler, response_format.schema or JSON_OBJECT_SCHEMA)
        except Exception as exc:  # xgrammar reports a bad grammar as RuntimeError, mostly
            raise InvalidGrammar(_ERROR_PREFIX.sub("", str(exc)).strip()) from None
        if not Matcher(compiled).allows_anything():
            raise InvalidGrammar("no output satisfies it")
        return compiled


def _compile_json(compiler: Any, schema: str) -> Any:
    # vLLM's settings (but MAX_WHITESPACE): any whitespace between tokens, and xgrammar's
    # strict mode (no properties or items beyond those the schema names, unless it allows
    # them), whatever json_schema.strict says
    return compiler.compile_json_schema(
        schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE
    )


def _compile_choice(compiler: Any, choices: str) -> Any:
    return compiler.compile_grammar(choice_grammar(json.loads(choices)))


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar of exactly the given strings, as vLLM's choice_as_grammar writes it
    (JSON's string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _compile_structural_tag(compiler: Any, text: str) -> Any:
    """vLLM's two forms: the legacy `structures` and `triggers`, or xgrammar's own."""
    tag = json.loads(text)
    if "structures" not in tag:
        return compiler.compile_structural_tag(text)
    xgr = _xgrammar()
    items = [
        xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in tag["structures"]
    ]
    return compiler.compile_structural_tag(items, tag["triggers"])


_COMPILE: dict[str, Callable[[Any, str], Any]] = {
    "json_object": _compile_json,
    "json_schema": _compile_json,
    "regex": lambda compiler, regex: compiler.compile_regex(regex),
    "choice": _compile_choice,
    "grammar": lambda compiler, ebnf: compiler.compile_grammar(ebnf),
    "structural_tag": _compile_structural_tag,
}
_KIND_NAMES = {
    "json_object": "JSON schema",
    "json_schema": "JSON schema",
    "grammar": "EBNF grammar",
}


class Matcher:
    """One request's position in its grammar: what may come next, and the tokens so far.

    `mask` is the tokens its state allows next (see BatchPlan.token_bitmasks), once a
    fill_masks has filled it; None until then, and again after each accepted token.
    `filling` is set while a fill_masks in a thread works on it. A grammar given as
    AfterReasoning starts once the reasoning has ended (service.engine.grammar_reasoning):
    inside it, its mask is the reasoning's, set at once, and it accepts every token; before
    a first token that may open it, fill_masks fills the grammar's mask with `opener` added."""

    __slots__ = ("_matcher", "_reasoning", "filling", "mask", "vocab_size")

    def __init__(self, compiled: Any) -> None:
        self._reasoning: ReasoningPhase | None = None
        if isinstance(compiled, AfterReasoning):
            self._reasoning = ReasoningPhase(compiled.end, compiled.budget, compiled.opener)
            compiled = compiled.compiled
        self._matcher = _xgrammar().GrammarMatcher(compiled)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self.mask: str | None = None
        self.filling = False
        if self._reasoning is not None:
            self._reasoning.vocab_size = self.vocab_size
            if self._reasoning.opener is None:
                self.mask = self._reasoning.mask()

    @property
    def needs_mask(self) -> bool:
        return self.mask is None and not self.filling

    @property
    def opener(self) -> int | None:
        """The token that would open a reasoning now, besides the grammar's; None: none."""
        return None if self._reasoning is None else self._reasoning.opener

    def allows_anything(self) -> bool:
        words = _xgrammar().allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(words)
        return bool(words.any())

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (and no change) if the grammar does not allow it."""
        phase = self._reasoning
        if phase is not None and not phase.declined_by(token):
            if phase.accept(token):
                self.mask = phase.mask()
            else:  # the reasoning has ended: the grammar begins, its first mask to fill
                self._reasoning = None
                self.mask = None
            return True
        accepted = bool(self._matcher.accept_token(token))
        if accepted:
            self._reasoning = None  # a first token that did not open the reasoning
            self.mask = None  # the state moved on: its next mask is another
        return accepted

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its end-of-sequence token."""
        return self._reasoning is None and bool(self._matcher.is_terminated())


def add_token(words: np.ndarray, token: int) -> None:
    """Allow `token` in a mask row of int32 words (bit t of word t // 32)."""
    words.view("<u4")[token // 32] |= np.uint32(1) << np.uint32(token % 32)


def fill_masks(
    matchers: Sequence[Matcher], threads: int = 1, stop: threading.Event | None = None
) -> list[str]:
    """The masks of `matchers`' current states, as the plan carries them, in their order;
    with `stop`, only those of the first rows filled before it was set (checked between
    chunks of `threads` rows, so it takes effect within one row's fill).

    Blocking: run it in a thread. xgrammar's batch fill releases the GIL and spreads each
    chunk over `threads` threads; the matchers must not accept a token meanwhile."""
    xgr = _xgrammar()
    # one server, one vocabulary: every matcher's rows are as wide
    words = xgr.allocate_token_bitmask(len(matchers), matchers[0].vocab_size)
    batch = xgr.BatchGrammarMatcher(threads)
    chunk = len(matchers) if stop is None else threads
    filled = 0
    while filled < len(matchers) and not (stop is not None and stop.is_set()):
        rows = range(filled, min(filled + chunk, len(matchers)))
        batch.batch_fill_next_token_bitmask([matchers[i]._matcher for i in rows], words, list(rows))
        filled = rows.stop
    packed = np.asarray(words[:filled].numpy(), dtype="<i4")
    for row, matcher in enumerate(matchers[:filled]):
        if matcher.opener is not None:
            add_token(packed[row], matcher.opener)
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in packed]
