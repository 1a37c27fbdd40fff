"""One request's state through its lifecycle, and the events its stream carries.

Lifecycle: waiting -> running (prefilling, then decoding) -> finished; a preempted request
goes back to waiting, keeping its generated tokens, and is recomputed later. All times are
on the engine clock (trio.current_time()), so tests can drive them with a MockClock.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from gpu_worker.protocol import SamplingSpec, TokenLogprobs
from service.engine.acceptance import Acceptance

if TYPE_CHECKING:
    from service.engine.detokenizer import Detokenizer
    from service.engine.grammar import Matcher
    from service.engine.kv_transfer import KvHold, RemoteKv


DEFAULT_TENANT = "default"
# SamplingParams.pooling: the last token's final hidden state, or the mean over the prompt
LAST_POOLING, MEAN_POOLING = "last", "mean"
POOLING_TYPES = (LAST_POOLING, MEAN_POOLING)
# "team/alice": the sub-tenant alice of the tenant team (an API key's, or one a client
# named): fairness, quotas and the prefix cache's isolation count the tenant, logs show both
SUB_TENANT_SEPARATOR = "/"


def account_of(tenant: str) -> str:
    """The tenant a request is accounted to: its name up to any sub-tenant."""
    return tenant.partition(SUB_TENANT_SEPARATOR)[0] or tenant


def _openai_default_sampling() -> SamplingSpec:
    return SamplingSpec(temperature=1.0)  # OpenAI's and vLLM's default temperature


@dataclass(slots=True)
class SamplingParams:
    """What a request asks for. `sampling` is the worker's part, sent with every plan as is;
    the rest is the service's: when to stop and what to send."""

    max_tokens: int | None = 16  # None: the rest of the context window
    stop: list[str] = field(default_factory=list)
    # tokens that end the sequence as EOS does (finish "stop"), their text left out, as vLLM
    stop_token_ids: list[int] = field(default_factory=list)
    # never generated: the engine sends their tokens to the worker (service.engine.sampling)
    bad_words: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens (EOS too) appear in the text
    # vLLM's: only requests with the same salt share cached prefix blocks (tenant isolation)
    cache_salt: str | None = None
    sampling: SamplingSpec = field(default_factory=_openai_default_sampling)
    # structured output: xgrammar's CompiledGrammar for response_format (service.engine.grammar)
    grammar: Any = None
    # an embedding, not a completion (POOLING_TYPES; then max_tokens is 0): the prompt's
    # final hidden states pooled, in the FinishEvent
    pooling: str | None = None
    # the LoRA adapter the request runs with (its `model` named it), and its directory when
    # the request was accepted: it runs with that one even if the name is unloaded meanwhile
    adapter: str | None = None
    adapter_path: str | None = None
    # disaggregated prefill and decode (service.engine.kv_transfer): a producer keeps the
    # prompt's blocks for a consumer when the request ends (vLLM's do_remote_decode); a
    # consumer pulls them from the producer that holds them (do_remote_prefill)
    remote_decode: bool = False
    remote_kv: RemoteKv | None = None


@dataclass(slots=True)
class TokenEvent:
    text: str  # newly decoded text since the previous event, stop strings already cut
    token_ids: list[int]
    logprobs: TokenLogprobs | None  # of token_ids, when the request asked for them
    # the first event of a request that asked for its prompt's: tokens 1.. of the prompt
    prompt_logprobs: TokenLogprobs | None = None
    index: int = 0  # which of the request's n sequences (`n` > 1 share one stream)


@dataclass(frozen=True, slots=True)
class Phases:
    """Where a request's time went, in seconds (None: it never got that far): waiting to be
    first scheduled, then its prefill up to its first token, then its decode up to its last.
    Its span, its `request.finished` line's queue_ms and a response's `metrics` read this."""

    queue: float | None
    prefill: float | None
    decode: float | None
    tokens: int  # output tokens sent

    @classmethod
    def at(
        cls,
        received: float,
        first_scheduled: float | None,
        first_token: float | None,
        token_times: Sequence[float],
    ) -> Phases:
        queue = prefill = decode = None
        if first_scheduled is not None:
            queue = first_scheduled - received
            if first_token is not None:
                prefill = first_token - first_scheduled
                decode = token_times[-1] - first_token
        return cls(queue, prefill, decode, len(token_times))


@dataclass(slots=True)
class FinishEvent:
    reason: str  # "stop" | "length" | "abort" | "error"
    # "eos" | "stop_string" | "max_tokens" | "aborted" | "shutdown" | "worker_died" |
    # "grammar_rejected" | ...
    detail: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed
    index: int = 0  # which of the request's n sequences finished
    embedding: list[float] | None = None  # a pooled request's (SamplingParams.pooling)
    phases: Phases | None = None  # where its time went
    # a producer's request whose blocks it holds for a consumer: where they are (the
    # answer's kv_transfer_params, service.engine.kv_transfer.producer_params)
    kv_transfer_params: dict[str, Any] | None = None
    stop_string: str | None = None  # the stop string that ended it (vLLM's stop_reason)


Event = TokenEvent | FinishEvent

# What an event holds in memory, roughly: the event, its list and id, then its text's
# characters and each log-probability entry (an id and a float in lists)
EVENT_BYTES = 256
LOGPROB_ENTRY_BYTES = 64


def event_bytes(event: Event) -> int:
    if isinstance(event, FinishEvent):
        return EVENT_BYTES
    entries = _entries(event.logprobs) + _entries(event.prompt_logprobs)
    return EVENT_BYTES + len(event.text) + entries * LOGPROB_ENTRY_BYTES


def _entries(logprobs: TokenLogprobs | None) -> int:
    if logprobs is None:
        return 0
    return len(logprobs.logprobs) + sum(map(len, logprobs.top_ids))


@dataclass(slots=True)
class UnreadBytes:
    """The bytes of a stream's events that its reader has not taken yet (shared by the n
    sequences of one stream), bounded by `limit`: a reader that falls that far behind
    ends its request, so a client that never reads holds at most this much of the server.

    The stream's channel says how many events it still holds; they are the newest of
    those sent, so the sizes kept here, oldest first, are dropped down to that count."""

    limit: int
    total: int = 0
    sizes: collections.deque[int] = field(default_factory=collections.deque)

    def take(self, size: int, queued: int, *, always: bool = False) -> bool:
        """Count an event of `size` bytes into a stream holding `queued` unread events;
        False, counting nothing, if it would pass the limit (unless `always`). An event
        into an empty stream always fits, so a large one never ends a reader that keeps up."""
        while len(self.sizes) > queued:
            self.total -= self.sizes.popleft()
        if not always and self.total and self.total + size > self.limit:
            return False
        self.sizes.append(size)
        self.total += size
        return True


class Status(enum.Enum):
    WAITING = "waiting"
    RECEIVING = "receiving"  # its prompt's K/V is being pulled: never scheduled for compute
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    seq_id: int  # engine-wide, increasing with arrival
    prompt_len: int
    token_ids: list[int]  # prompt followed by the generated tokens
    params: SamplingParams  # max_tokens is set (validation fills the default)
    tenant: str
    priority: int
    received: float
    stream: trio.MemorySendChannel
    detokenizer: Detokenizer
    unread: UnreadBytes | None = None  # of its stream; None: unbounded in bytes
    grammar: Matcher | None = None  # structured output: where its output is in its grammar
    status: Status = Status.WAITING
    index: int = 0  # its place among the n sequences of one client request
    num_computed_tokens: int = 0  # tokens whose K/V is in the worker's cache
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, chained
    # of prompt tokens 1.. as computed so far, when its sampling asks for them (`echo`)
    prompt_logprobs: TokenLogprobs | None = None
    # a pooled request's vector so far: the sum of its rows' hidden states (mean pooling),
    # then the pooled embedding once its prompt is computed
    pooled: list[float] | None = None
    admitted_order: int = -1  # increasing each time it is admitted, for "most recently admitted"
    preemptions: int = 0
    deadline: float | None = None  # engine clock: not started by then, it is refused
    # the caller's W3C trace context (service.engine.trace_context): its span's parent
    trace_headers: dict[str, str] | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)  # of its drafted tokens
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None
    kv_hold: KvHold | None = None  # a producer's: its blocks held for a consumer's pull

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample (1 for a decoding sequence)."""
        return max(1, len(self.token_ids) - self.num_computed_tokens)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are wanted and not all computed yet."""
        found = self.prompt_logprobs
        return found is not None and len(found) < self.prompt_len - 1

    @property
    def computes_whole_prompt(self) -> bool:
        """Its prompt must be computed, not taken from the prefix cache: for its prompt's
        log-probabilities, or the mean of its hidden states."""
        return self.needs_prompt_logprobs or self.params.pooling == MEAN_POOLING

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def phases(self) -> Phases:
        return Phases.at(self.received, self.first_scheduled, self.first_token, self.token_times)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the cache is gone, the tokens are kept."""
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.preemptions += 1

    def send(self, event: Event) -> bool:
        """Never blocks (the channel holds max_tokens + 2 events); a gone reader is ignored.
        False, sending nothing, if the token event would pass the stream's unread bytes."""
        unread, finish = self.unread, isinstance(event, FinishEvent)
        if unread is not None:
            queued = self.stream.statistics().current_buffer_used
            if not unread.take(event_bytes(event), queued, always=finish):
                return False
        with contextlib.suppress(
            trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock
        ):
            self.stream.send_nowait(event)
        return True

    def drop_unsent(self) -> None:
        """A stop string ended the text at the token just sent: the tokens update() appended
        after it (the rest of a step's accepted drafts) are not the output's, nor its usage's."""
        del self.token_ids[self.prompt_len + len(self.token_times) :]
