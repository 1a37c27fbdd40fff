"""Plain records the engine emits once per iteration and once per finished request.

The structured log, the Prometheus metrics and the admin state all read these; the
engine does not know who listens (see Engine.add_observer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol


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
    schedule_ms: float  # service-side: view, decision, validation, plan building
    preempted: int  # sequences preempted at this iteration


@dataclass(frozen=True, slots=True)
class RequestStats:
    request_id: str
    tenant: str
    policy: str  # policy in force when the request finished
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    finish_detail: str  # "eos" | "stop_string" | "max_tokens" | "aborted" | "error: ..."
    prompt_tokens: int
    completion_tokens: int
    received: float  # engine clock, seconds
    first_scheduled: float | None
    first_token: float | None
    finished: float
    token_times: tuple[float, ...]  # when each output token was emitted, engine clock
    preemptions: int

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.received

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.received

    @property
    def e2e(self) -> float:
        return self.finished - self.received

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return None if n < 2 else (self.token_times[-1] - self.token_times[0]) / (n - 1)


class Observer(Protocol):
    def on_request_received(self, request_id: str, tenant: str, prompt_tokens: int) -> None: ...
    def on_iteration(self, stats: IterationStats) -> None: ...
    def on_request_finished(self, stats: RequestStats) -> None: ...
    def on_preemption(self, request_id: str) -> None: ...
    def on_policy_swap(self, old: str, new: str, iteration: int) -> None: ...
