"""vLLM's sampling parameters beyond temperature, top-p and top-k, read from a body.

The penalties, min_p, logit_bias, allowed_token_ids and min_tokens go to the worker's logit
processors (gpu_worker.logit_processors) in the SamplingSpec; stop_token_ids and bad_words
are the engine's first (it finishes on the one and tokenizes the other). This reads types
only: the ranges are service.engine.validation's.
"""

from __future__ import annotations

import math
from typing import Any

from service.api.errors import bad_request
from service.api.fields import Fields


def spec_fields(fields: Fields) -> dict[str, Any]:
    """SamplingSpec's fields for the logit processors."""
    return {
        "presence_penalty": fields.number("presence_penalty", 0.0),
        "frequency_penalty": fields.number("frequency_penalty", 0.0),
        "repetition_penalty": fields.number("repetition_penalty", 1.0),
        "min_p": fields.number("min_p", 0.0),
        "logit_bias": _logit_bias(fields.raw("logit_bias")),
        "allowed_token_ids": _token_ids(fields.raw("allowed_token_ids"), "allowed_token_ids"),
        "min_tokens": fields.integer("min_tokens", 0) or 0,
    }


def params_fields(fields: Fields) -> dict[str, Any]:
    """SamplingParams' fields for the engine: stop_token_ids and bad_words."""
    words = fields.raw("bad_words")
    if words is not None and (
        not isinstance(words, list) or not all(isinstance(w, str) for w in words)
    ):
        raise bad_request("'bad_words' must be a list of strings", "bad_words")
    return {
        "stop_token_ids": _token_ids(fields.raw("stop_token_ids"), "stop_token_ids") or [],
        "bad_words": list(words or []),
    }


def _token_ids(value: Any, param: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise bad_request(f"'{param}' must be a list of token ids", param)
    return list(value)


def _logit_bias(value: Any) -> list[tuple[int, float]]:
    """OpenAI's map of token ids (as strings, JSON's keys) to biases -> (id, bias) pairs."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object of token ids to biases", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdecimal()) or not _is_number(bias):
            raise bad_request(
                f"'logit_bias' maps token ids to numbers; got {key!r}: {bias!r}", "logit_bias"
            )
        pairs.append((int(key), float(bias)))
    return sorted(pairs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))
