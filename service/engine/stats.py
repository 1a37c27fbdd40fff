"""Plain records the engine emits once per iteration and once per finished request.

The structured log, the Prometheus metrics and the admin state all read these; the
engine does not know who listens (see Engine.add_observer).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from service.engine.request import Phases

if TYPE_CHECKING:
    from service.engine.request import Request


@dataclass(frozen=True, slots=True)
class IterationStats:
    iteration: int
    policy: str
    prefill_tokens: int
    decode_seqs: int
    batch_tokens: int
    num_seqs: int
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    step_ms: float  # measured in the worker
    # service-side: view, decision, validation, plan building, results (text, events); with
    # overlap the results part runs while the worker computes the next step
    schedule_ms: float
    preempted: int  # sequences preempted at this iteration
    # the worker's wait for this plan after its previous result; None when it was idle anyway
    worker_idle_ms: float | None
    # speculative decoding: sequences with drafted tokens, those tokens, and how many of
    # them the worker accepted
    drafting_seqs: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # LoRA: the adapters its rows ran with, and those its plan loaded into slots
    adapters: tuple[str, ...] = ()
    adapter_loads: int = 0


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """One milestone of a request's story (received, admitted, prefill_chunk, preempted,
    resumed, first_token): its log line `request.<name>` and what observers (the traces)
    get are this one record, so that logs and traces tell the same story."""

    request_id: str
    name: str
    at: float  # engine clock, seconds
    fields: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class RequestStats:
    """A finished request's measures, built once: the log line, the metrics and the tests
    all read this record."""

    request_id: str
    tenant: str
    policy: str  # policy in force when the request finished
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    finish_detail: str
    prompt_tokens: int
    completion_tokens: int
    received: float  # engine clock, seconds
    first_scheduled: float | None
    first_token: float | None
    finished: float
    token_times: tuple[float, ...]  # when each output token was emitted, engine clock
    preemptions: int
    iteration: int  # the last iteration begun when it finished
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    draft_tokens: int = 0  # tokens it drafted (speculative decoding), over its life
    accepted_tokens: int = 0  # of those, accepted
    adapter: str | None = None  # its LoRA adapter; None: the base model

    @classmethod
    def of(cls, request: Request, policy: str, iteration: int) -> RequestStats:
        assert request.finished is not None
        return cls(
            request_id=request.request_id,
            tenant=request.tenant,
            policy=policy,
            finish_reason=request.finish_reason or "error",
            finish_detail=request.finish_detail or "",
            prompt_tokens=request.prompt_len,
            completion_tokens=request.num_generated,
            received=request.received,
            first_scheduled=request.first_scheduled,
            first_token=request.first_token,
            finished=request.finished,
            token_times=tuple(request.token_times),
            preemptions=request.preemptions,
            iteration=iteration,
            cached_tokens=request.num_cached_tokens,
            adapter=request.params.adapter,
            draft_tokens=request.acceptance.drafted,
            accepted_tokens=request.acceptance.accepted,
        )

    @property
    def queue_time(self) -> float | None:
        return self.phases.queue

    @property
    def phases(self) -> Phases:
        return Phases.at(self.received, self.first_scheduled, self.first_token, self.token_times)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.received

    @property
    def e2e(self) -> float:
        return self.finished - self.received

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def largest_gap(self) -> tuple[int, float] | None:
        """The longest wait between two of its tokens: (the index of the token that ended
        it, its seconds); None with fewer than two tokens."""
        return _largest_gap(self.itls)

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return None if n < 2 else (self.token_times[-1] - self.token_times[0]) / (n - 1)

    def log_fields(self) -> dict[str, object]:
        """The `request.finished` log line: the record's facts and its latency summary."""
        gaps = self.itls
        gap, itls = _largest_gap(gaps), sorted(gaps)
        return {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "adapter": self.adapter,
            "policy": self.policy,
            "finish_reason": self.finish_reason,
            "finish_detail": self.finish_detail,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_ms": _ms(self.ttft),
            "itl_p50_ms": _ms(_percentile(itls, 0.50)),
            "itl_p99_ms": _ms(_percentile(itls, 0.99)),
            "itl_max_ms": _ms(gap[1] if gap else None),
            "itl_max_token": gap[0] if gap else None,  # the token that ended that gap
            "queue_ms": _ms(self.queue_time),
            "e2e_ms": _ms(self.e2e),
            "preemptions": self.preemptions,
            "iteration": self.iteration,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
        }


def _largest_gap(itls: list[float]) -> tuple[int, float] | None:
    if not itls:
        return None
    index = max(range(len(itls)), key=itls.__getitem__)
    return index + 1, itls[index]


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))
    return sorted_values[index]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


class Observer(Protocol):
    def on_request_received(self, request_id: str, tenant: str, prompt_tokens: int) -> None: ...
    def on_iteration(self, stats: IterationStats) -> None: ...
    def on_request_finished(self, stats: RequestStats) -> None: ...
    def on_preemption(self, request_id: str) -> None: ...
    def on_policy_swap(self, old: str, new: str, iteration: int) -> None: ...
    def on_request_refused(self, reason: str) -> None: ...
    def on_request_event(self, event: RequestEvent) -> None: ...
