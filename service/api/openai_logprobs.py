"""The `logprobs` objects of a response: the engine's token events (and, for `echo`, the
prompt) as text pieces with their log-probabilities, in the shape of the request's API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_worker.protocol import TokenLogprobs
from service.api.openai_responses import TokenPieces, chat_logprobs, completion_logprobs
from service.api.openai_schema import GenerationRequest
from service.engine.detokenizer import Decoder
from service.engine.request import TokenEvent


@dataclass(slots=True)
class Echo:
    """The prompt a completion with `echo` returns before its own text."""

    text: str
    token_ids: list[int]


def token_pieces(tokenizer: Decoder, events: list[TokenEvent]) -> TokenPieces:
    pieces = TokenPieces()
    for event in events:
        pieces.pieces += [piece_of(tokenizer, token_id) for token_id in event.token_ids]
        found = event.logprobs
        if found is None:
            pieces.logprobs += [None] * len(event.token_ids)
            pieces.top += [None] * len(event.token_ids)
        else:
            pieces.logprobs += found.logprobs
            pieces.top += alternatives(tokenizer, found)
    return pieces


def prompt_pieces(tokenizer: Decoder, echo: Echo, found: TokenLogprobs | None) -> TokenPieces:
    """The prompt's tokens: the first has no log-probability, the others what the worker
    computed for them."""
    found = found or TokenLogprobs()
    return TokenPieces(
        pieces=[piece_of(tokenizer, token_id) for token_id in echo.token_ids],
        logprobs=[None, *found.logprobs],
        top=[None, *alternatives(tokenizer, found)],
    )


def alternatives(tokenizer: Decoder, found: TokenLogprobs) -> list[list[tuple[str, float]] | None]:
    return [
        [(piece_of(tokenizer, i), lp) for i, lp in zip(ids, values, strict=True)]
        for ids, values in zip(found.top_ids, found.top_logprobs, strict=True)
    ]


def piece_of(tokenizer: Decoder, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def logprobs_of(
    req: GenerationRequest,
    tokenizer: Decoder,
    tokens: list[TokenEvent],
    text_offset: int,
    echo: Echo | None,
) -> dict[str, Any] | None:
    """The `logprobs` object of a response or stream chunk holding `tokens` (after the
    prompt, when `echo` is given: the first chunk of an echoing completion)."""
    if not req.params.sampling.logprobs:
        return None
    pieces = token_pieces(tokenizer, tokens)
    if req.kind == "chat":
        return chat_logprobs(pieces)
    if echo is not None:
        prompt = prompt_pieces(tokenizer, echo, tokens[0].prompt_logprobs if tokens else None)
        prompt.extend(pieces)
        pieces = prompt
    return completion_logprobs(pieces, text_offset, req.params.sampling.top_logprobs)
