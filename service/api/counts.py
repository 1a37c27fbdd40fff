"""The bounds of every count a client sends, checked as the body is read.

A count sizes work: `n` sequences (each with its ids, state and stream), `max_tokens` of
events, `logprobs` alternatives a token. Read unbounded, one body could make the server
allocate for a billion sequences before the engine's validation ever saw the request (and
did: `n` of 10**9 grew the server to 23 GB until the kernel killed it). So each count is
refused here, with a 400 naming its field, before any route or the engine sizes anything
by it; the OpenAPI document (service.api.openapi) states the same bounds from this table.
The engine's validation still checks what reaches it by other ways (the offline API).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.api.errors import bad_request
from service.engine.validation import MAX_LOGPROBS, MAX_PRIORITY, MAX_SEED, MAX_SEQUENCES


@dataclass(frozen=True, slots=True)
class Count:
    minimum: int
    maximum: int | None  # None: the model's context window (not bounded before it is known)
    description: str = ""


# Lengths of lists (prompts, messages, stop strings, token ids) are bounded where each list
# is read, since the body's size already bounds the memory it holds.
COUNTS: dict[str, Count] = {
    "n": Count(1, MAX_SEQUENCES, "choices to generate; they share the prompt's KV blocks"),
    "best_of": Count(
        1,
        MAX_SEQUENCES,
        "sequences to generate (at least n), of which the n of highest cumulative "
        "log-probability are returned; more than n cannot be streamed",
    ),
    "max_tokens": Count(1, None),
    "max_completion_tokens": Count(1, None),
    "max_output_tokens": Count(1, None),  # the Responses API's
    "min_tokens": Count(
        0, None, "EOS and stop_token_ids cannot be sampled before this many tokens"
    ),
    "thinking_token_budget": Count(
        1,
        None,
        "vLLM's: the most tokens the reasoning may have before its end marker is forced "
        "(needs --reasoning-parser, a reasoning the prompt or the model opens, and a grammar)",
    ),
    "logprobs": Count(
        0,
        MAX_LOGPROBS,
        "each token's log-probability and its k most likely alternatives (with the chosen "
        "token: up to k + 1)",
    ),
    "top_logprobs": Count(
        0, MAX_LOGPROBS, "the k most likely alternatives of each token; needs logprobs"
    ),
    "seed": Count(0, MAX_SEED),
    "priority": Count(
        -MAX_PRIORITY,
        MAX_PRIORITY,
        "vLLM's: lower runs first (default 0), under the priority policy",
    ),
}


def check_count(name: str, value: int, window: int | None) -> int:
    """`value` of the count `name`, or a 400 naming it; `window`: the context window (None:
    not known yet, and the counts bounded by it are checked later by the engine)."""
    count = COUNTS[name]
    if count.maximum is None and window is not None and value > window:
        raise bad_request(
            f"'{name}' is {value}, more than this model's maximum context length of "
            f"{window} tokens",
            name,
            "context_length_exceeded",
        )
    if value < count.minimum or (count.maximum is not None and value > count.maximum):
        upper = "" if count.maximum is None else f" and at most {count.maximum}"
        raise bad_request(f"'{name}' must be at least {count.minimum}{upper}, got {value}", name)
    return value


def count_schema(name: str, window: int | None) -> dict[str, Any]:
    """The OpenAPI schema of the count `name` (null: its default)."""
    count = COUNTS[name]
    schema: dict[str, Any] = {"type": ["integer", "null"], "minimum": count.minimum}
    most = count.maximum if count.maximum is not None else window
    if most is not None:
        schema["maximum"] = most
    if count.description:
        schema["description"] = count.description
    return schema
