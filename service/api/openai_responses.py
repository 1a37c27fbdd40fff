"""Response objects shaped like OpenAI's: completions, chat completions, their stream chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from service.engine.request import FinishEvent


@dataclass(slots=True)
class ResponseHeader:
    """What every object of one response shares."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    # the engine's requests behind it (a list prompt has one a prompt); empty: request_id
    engine_ids: tuple[str, ...] = ()

    def base(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }


@dataclass(slots=True)
class TokenPieces:
    """Tokens as text pieces, with their log-probabilities and their alternatives (each a
    list of (piece, logprob), most likely first); None where there are none: a prompt's
    first token."""

    pieces: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[str, float]] | None] = field(default_factory=list)

    def extend(self, other: TokenPieces) -> None:
        self.pieces += other.pieces
        self.logprobs += other.logprobs
        self.top += other.top


def usage(finishes: list[FinishEvent], cached_tokens: bool, per_prompt: int) -> dict[str, Any]:
    """OpenAI's usage object for a request's sequences (`finishes`, by index, `per_prompt`
    of each prompt): each prompt once, every sequence's tokens, and (`cached_tokens`: where
    the operator allows it, since it tells what others sent before) the prompt tokens the
    prefix cache served the first of each prompt (the others share what it computed)."""
    firsts = finishes[::per_prompt]
    prompt = sum(finish.prompt_tokens for finish in firsts)
    completion = sum(finish.completion_tokens for finish in finishes)
    details = {"cached_tokens": sum(f.cached_tokens for f in firsts)} if cached_tokens else None
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


def request_metrics(finishes: list[FinishEvent]) -> dict[str, Any] | None:
    """vLLM's per-request `metrics` (--enable-per-request-metrics) from the one sequence's
    phases, in ms; None for several sequences (n > 1, several prompts), as vLLM's: the
    times are one stream's. vLLM's time_to_first_token_ms runs from the first schedule."""
    if len(finishes) != 1 or finishes[0].phases is None:
        return None
    phases = finishes[0].phases
    prefill, decode, tokens = phases.prefill, phases.decode, phases.tokens
    inference = None if prefill is None or decode is None else prefill + decode
    return {
        "time_to_first_token_ms": _ms(prefill),
        "generation_time_ms": _ms(decode),
        "queue_time_ms": _ms(phases.queue),
        "mean_itl_ms": _ms(decode / (tokens - 1)) if decode is not None and tokens > 1 else None,
        "tokens_per_second": tokens / inference if inference else None,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def completion_logprobs(tokens: TokenPieces, text_offset: int, top_k: int) -> dict[str, Any]:
    """OpenAI's legacy shape; as vLLM, each `top_logprobs` entry holds the k best and the
    chosen token (so up to k + 1), and there are none when k is 0."""
    offsets = []
    for piece in tokens.pieces:
        offsets.append(text_offset)
        text_offset += len(piece)
    top_logprobs = None
    if top_k > 0:
        top_logprobs = [
            None if logprob is None or top is None else dict(top) | {piece: logprob}
            for piece, logprob, top in zip(tokens.pieces, tokens.logprobs, tokens.top, strict=True)
        ]
    return {
        "tokens": tokens.pieces,
        "token_logprobs": tokens.logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(tokens: TokenPieces) -> dict[str, Any]:
    return {
        "content": [
            {
                **_chat_token(piece, logprob),
                "top_logprobs": [_chat_token(p, lp) for p, lp in top or ()],
            }
            for piece, logprob, top in zip(tokens.pieces, tokens.logprobs, tokens.top, strict=True)
        ]
    }


def _chat_token(piece: str, logprob: float | None) -> dict[str, Any]:
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


@dataclass(slots=True)
class Choice:
    """One finished sequence of a whole (not streamed) response."""

    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None
    message: dict[str, Any] | None = None  # a chat's, when its answer was read for more


def finish_reason_of(reason: str, called: bool) -> str:
    """A sequence that stopped after calling tools finished for that reason."""
    return "tool_calls" if called and reason == "stop" else reason


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's continuous_usage_stats: the counts so far, on every chunk."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    header: ResponseHeader, choices: list[Choice], usage_: dict[str, Any]
) -> dict[str, Any]:
    body = header.base("chat.completion" if header.kind == "chat" else "text_completion")
    body["choices"] = [_full_choice(header, i, choice) for i, choice in enumerate(choices)]
    body["usage"] = usage_
    return body


def _full_choice(header: ResponseHeader, index: int, choice: Choice) -> dict[str, Any]:
    if header.kind == "chat":
        return {
            "index": index,
            "message": choice.message or {"role": "assistant", "content": choice.text},
            "logprobs": choice.logprobs,
            "finish_reason": choice.finish_reason,
        }
    return {
        "index": index,
        "text": choice.text,
        "logprobs": choice.logprobs,
        "finish_reason": choice.finish_reason,
    }


def delta_chunk(
    header: ResponseHeader,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    *,
    role: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """One stream chunk of choice `index`: new text (or none, for the final chunk carrying
    finish_reason)."""
    if header.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        body = header.base("chat.completion.chunk")
    else:
        choice = {
            "index": index,
            "text": text or "",
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        body = header.base("text_completion")
    body["choices"] = [choice]
    return body


def message_chunk(
    header: ResponseHeader, delta: dict[str, Any], logprobs: dict[str, Any] | None, index: int
) -> dict[str, Any]:
    """A chat stream chunk whose delta was read from the answer (reasoning, calls)."""
    body = header.base("chat.completion.chunk")
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
    body["choices"] = [choice]
    return body


def usage_chunk(header: ResponseHeader, usage_: dict[str, Any]) -> dict[str, Any]:
    body = header.base("chat.completion.chunk" if header.kind == "chat" else "text_completion")
    body["choices"] = []
    body["usage"] = usage_
    return body
