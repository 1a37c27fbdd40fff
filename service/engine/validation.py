"""The one check of a request before it enters the engine.

Every way in (the HTTP routes, the offline API, the benchmarks) goes through Engine.submit,
which runs `validate`; the HTTP layer only parses JSON into typed fields, and the worker
keeps a cheap consistency guard of each plan. Errors carry OpenAI's `param` and `code`, so
the routes can answer in OpenAI's error shape without knowing the rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from service.engine.request import POOLING_TYPES, SamplingParams

MAX_STOP_STRINGS = 16
# Real stop strings are short (a role marker, a closing tag, a fence); 256 characters leaves
# them ample room while bounding what a stream may hold back (up to 255 characters that could
# begin a stop) and the matcher's per-request tables (16 x 256 entries).
MAX_STOP_CHARS = 256
MAX_TENANT_CHARS = 128
MAX_PRIORITY = 1_000_000
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_LOGPROBS = 20  # alternatives per token (chat's `top_logprobs`; vLLM's max_logprobs too)
MAX_SEQUENCES = 32  # sequences generated for one request (`n`, `best_of`)
MAX_DEADLINE_S = 86_400.0  # a day
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100] (OpenAI's)
# Each step gathers a row's token lists in Python (gpu_worker.logit_processors): bounded so
# that no request makes every step of its batch slow.
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64


class InvalidRequest(ValueError):
    """A request the engine cannot serve; the message is meant for the user (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int  # the most tokens one request can hold in the KV cache


def validate(
    prompt_ids: list[int],
    params: SamplingParams,
    limits: Limits,
    tenant: str,
    priority: int,
    *,
    sequences: int = 1,
    deadline_s: float | None = None,
) -> None:
    """Raise InvalidRequest for the first problem found; fills a missing max_tokens with
    the rest of the context window. `param` names the engine's argument (Engine.submit's,
    SamplingSpec's field): an API names its own field where it differs."""
    _check_prompt(prompt_ids, limits)
    _check_sampling(params)
    _check_logprobs(params.sampling.top_logprobs, params.sampling.prompt_logprobs)
    _check_processors(params, limits.vocab_size)
    _check_routing(tenant, priority)
    _check_sequences(sequences)
    _check_deadline(deadline_s)
    if params.max_tokens is None:
        params.max_tokens = max(1, limits.max_model_len - len(prompt_ids))
    _check_min_tokens(params.sampling.min_tokens, params.max_tokens)
    _check_length(len(prompt_ids), params.max_tokens, limits)


def _check_prompt(ids: list[int], limits: Limits) -> None:
    if not ids:
        raise InvalidRequest("the prompt is empty after tokenization", "prompt")
    if len(ids) > limits.max_model_len:  # before the walk over every id below
        raise InvalidRequest(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {len(ids)} tokens in the prompt. Please reduce the length of the "
            "prompt.",
            "prompt",
            "context_length_exceeded",
        )
    vocab_size = limits.vocab_size
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(
            f"prompt token ids must be integers in [0, {vocab_size}) (the vocabulary)", "prompt"
        )


def _check_sampling(params: SamplingParams) -> None:
    spec = params.sampling
    if not _is_number(spec.temperature) or not 0 <= spec.temperature <= MAX_TEMPERATURE:
        raise InvalidRequest(
            f"temperature must be between 0 and {MAX_TEMPERATURE}, got {spec.temperature!r}",
            "temperature",
        )
    if not _is_number(spec.top_p) or not 0 < spec.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {spec.top_p!r}", "top_p")
    if not _is_int(spec.top_k) or spec.top_k < 0:
        raise InvalidRequest(f"top_k must be an integer >= 0, got {spec.top_k!r}", "top_k")
    if spec.seed is not None and (not _is_int(spec.seed) or not 0 <= spec.seed <= MAX_SEED):
        raise InvalidRequest(f"seed must be an integer in [0, {MAX_SEED}]", "seed")
    max_tokens = params.max_tokens
    if params.pooling is not None:
        _check_pooling(params)
    elif max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens!r}", "max_tokens")
    _check_stop(params.stop)


def _check_pooling(params: SamplingParams) -> None:
    """A pooled request computes its prompt and generates nothing."""
    if params.pooling not in POOLING_TYPES:
        raise InvalidRequest(
            f"pooling must be one of {', '.join(POOLING_TYPES)}, got {params.pooling!r}", "pooling"
        )
    if params.max_tokens != 0:
        raise InvalidRequest(
            "a pooled request generates no tokens: max_tokens must be 0", "max_tokens"
        )


def _check_processors(params: SamplingParams, vocab_size: int) -> None:
    """vLLM's ranges for its logit processors' parameters (OpenAI's where it has them)."""
    spec = params.sampling
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(spec, name)
        if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequest(f"{name} must be between -2 and 2, got {value!r}", name)
    if not _is_number(spec.repetition_penalty) or spec.repetition_penalty <= 0:
        raise InvalidRequest(
            f"repetition_penalty must be greater than 0, got {spec.repetition_penalty!r}",
            "repetition_penalty",
        )
    if not _is_number(spec.min_p) or not 0 <= spec.min_p <= 1:
        raise InvalidRequest(f"min_p must be in [0, 1], got {spec.min_p!r}", "min_p")
    _check_logit_bias(spec.logit_bias, vocab_size)
    if spec.allowed_token_ids is not None:
        _check_token_ids(spec.allowed_token_ids, "allowed_token_ids", vocab_size)
        if not spec.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids must not be empty", "allowed_token_ids")
        if len(spec.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidRequest(
                f"allowed_token_ids may list at most {MAX_ALLOWED_TOKEN_IDS} tokens",
                "allowed_token_ids",
            )
    _check_token_ids(params.stop_token_ids, "stop_token_ids", vocab_size)
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stop_token_ids may list at most {MAX_STOP_TOKEN_IDS} tokens", "stop_token_ids"
        )
    _check_bad_words(params.bad_words)


def _check_logit_bias(pairs: list[tuple[int, float]], vocab_size: int) -> None:
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest(
            f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens", "logit_bias"
        )
    _check_token_ids([token for token, _ in pairs], "logit_bias", vocab_size)
    for token, bias in pairs:
        if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias values must be between -100 and 100, got {bias!r} for {token}",
                "logit_bias",
            )


def _check_token_ids(ids: object, param: str, vocab_size: int) -> None:
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(
            f"{param} must hold token ids in [0, {vocab_size}) (the vocabulary)", param
        )


def _check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if not _is_int(min_tokens) or min_tokens < 0:
        raise InvalidRequest(
            f"min_tokens must be an integer >= 0, got {min_tokens!r}", "min_tokens"
        )
    if min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens"
        )


def _check_bad_words(words: list[str]) -> None:
    # a blank word is no tokens to ban (the rule strips leading spaces)
    _check_texts(words, "bad_words", "bad word", MAX_BAD_WORDS, lambda w: bool(w.strip()))


def _check_stop(stop: list[str]) -> None:
    _check_texts(stop, "stop", "stop string", MAX_STOP_STRINGS, bool)


def _check_texts(
    texts: list[str], param: str, noun: str, most: int, usable: Callable[[str], bool]
) -> None:
    if not isinstance(texts, list) or not all(isinstance(t, str) and usable(t) for t in texts):
        raise InvalidRequest(f"{param} must be a list of non-empty strings", param)
    if len(texts) > most:
        raise InvalidRequest(f"{param} accepts at most {most} strings", param)
    if any(len(t) > MAX_STOP_CHARS for t in texts):
        raise InvalidRequest(f"each {noun} may have at most {MAX_STOP_CHARS} characters", param)


def _check_logprobs(top: int, prompt: int | None) -> None:
    for name, value in (("top_logprobs", top), ("prompt_logprobs", prompt)):
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
            raise InvalidRequest(
                f"at most {MAX_LOGPROBS} log-probabilities per token can be returned "
                f"({name}: {value!r})",
                name,
            )


def _check_sequences(sequences: int) -> None:
    if not _is_int(sequences) or not 1 <= sequences <= MAX_SEQUENCES:
        raise InvalidRequest(
            f"a request generates 1 to {MAX_SEQUENCES} sequences, not {sequences!r}", "n"
        )


def _check_deadline(deadline_s: float | None) -> None:
    if deadline_s is not None and (
        not _is_number(deadline_s) or not 0 < deadline_s <= MAX_DEADLINE_S
    ):
        raise InvalidRequest(
            f"a deadline is more than 0 and at most a day ({MAX_DEADLINE_S:g} s), "
            f"not {deadline_s!r} s",
            "deadline_s",
        )


def _check_routing(tenant: str, priority: int) -> None:
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
        raise InvalidRequest(
            f"the tenant name must have 1 to {MAX_TENANT_CHARS} characters", "user"
        )
    if not _is_int(priority) or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequest(
            f"priority must be an integer between {-MAX_PRIORITY} and {MAX_PRIORITY}", "priority"
        )


def _check_length(prompt_tokens: int, max_tokens: int, limits: Limits) -> None:
    total = prompt_tokens + max_tokens
    if total > limits.max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {total} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
            "completion). Please reduce the length of the prompt or completion.",
            "max_tokens",
            "context_length_exceeded",
        )
    if total > limits.kv_capacity_tokens:
        raise InvalidRequest(
            f"prompt + max_tokens = {total} tokens exceeds the KV cache capacity of "
            f"{limits.kv_capacity_tokens} tokens for one request",
            "max_tokens",
            "kv_capacity_exceeded",
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))
