"""The `logprobs` objects of a response: the engine's token events (and, for `echo`, the
prompt) as text pieces with their log-probabilities, in the shape of the request's API.

Pieces come from the tokenizer's table (each id decoded once at start), so the per-token
work on the event loop is a lookup; its volume is capped before a request is queued
(`logprob_entries`, --max-logprob-entries)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpu_worker.protocol import TokenLogprobs
from service.api.openai_responses import TokenPieces, chat_logprobs, completion_logprobs
from service.api.openai_schema import GenerationRequest
from service.engine.request import TokenEvent


@dataclass(slots=True)
class Echo:
    """The prompt a completion with `echo` returns before its own text."""

    text: str
    token_ids: list[int]


def token_pieces(table: Sequence[str], events: list[TokenEvent]) -> TokenPieces:
    pieces = TokenPieces()
    for event in events:
        pieces.pieces += [piece(table, i) for i in event.token_ids]
        found = event.logprobs
        if found is None:
            pieces.logprobs += [None] * len(event.token_ids)
            pieces.top += [None] * len(event.token_ids)
        else:
            pieces.logprobs += found.logprobs
            pieces.top += alternatives(table, found)
    return pieces


def prompt_pieces(table: Sequence[str], echo: Echo, found: TokenLogprobs | None) -> TokenPieces:
    """The prompt's tokens: the first has no log-probability, the others what the worker
    computed for them."""
    found = found or TokenLogprobs()
    return TokenPieces(
        pieces=[piece(table, i) for i in echo.token_ids],
        logprobs=[None, *found.logprobs],
        top=[None, *alternatives(table, found)],
    )


def alternatives(
    table: Sequence[str], found: TokenLogprobs
) -> list[list[tuple[str, float]] | None]:
    return [
        [(piece(table, i), lp) for i, lp in zip(ids, values, strict=True)]
        for ids, values in zip(found.top_ids, found.top_logprobs, strict=True)
    ]


def piece(table: Sequence[str], token_id: int) -> str:
    # A model's vocabulary may be padded past its tokenizer's: those ids have no text.
    return table[token_id] if token_id < len(table) else ""


def logprobs_of(
    req: GenerationRequest,
    table: Sequence[str],
    tokens: list[TokenEvent],
    text_offset: int,
    echo: Echo | None,
) -> dict[str, Any] | None:
    """The `logprobs` object of a response or stream chunk holding `tokens` (after the
    prompt, when `echo` is given: the first chunk of an echoing completion)."""
    if not req.params.sampling.logprobs:
        return None
    pieces = token_pieces(table, tokens)
    if req.kind == "chat":
        return chat_logprobs(pieces)
    if echo is not None:
        prompt = prompt_pieces(table, echo, tokens[0].prompt_logprobs if tokens else None)
        prompt.extend(pieces)
        pieces = prompt
    return completion_logprobs(pieces, text_offset, req.params.sampling.top_logprobs)
