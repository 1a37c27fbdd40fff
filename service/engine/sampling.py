"""A request's sampling as the worker takes it: what the engine adds to the client's.

The worker's logit processors (gpu_worker.logit_processors) read token ids only. Two of
them need facts the client does not send: bad words are strings, which become token
sequences here (as vLLM's SamplingParams.update_from_tokenizer makes them), and min_tokens
holds back the tokens that would end the sequence, which are the request's stop_token_ids
and, unless ignore_eos, the model's end-of-sequence tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

from service.engine.request import SamplingParams

Encode = Callable[[str], list[int]]


def worker_sampling(
    params: SamplingParams, encode: Encode, eos_token_ids: Collection[int]
) -> SamplingParams:
    """`params` with its SamplingSpec completed for the worker (params itself if nothing
    is to add)."""
    spec = params.sampling
    changes: dict[str, Any] = {}
    if params.bad_words:
        changes["bad_words"] = bad_words_token_ids(params.bad_words, encode)
    if spec.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        changes["min_tokens_stop_ids"] = sorted(stops)
    if not changes:
        return params
    return dataclasses.replace(params, sampling=dataclasses.replace(spec, **changes))


def bad_words_token_ids(words: list[str], encode: Encode) -> list[list[int]]:
    """Each word as the model would write it at the start of a text and, where that is
    other tokens of the same count, after a space (vLLM's rule)."""
    found: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if not bare:
            continue
        found.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    return found
