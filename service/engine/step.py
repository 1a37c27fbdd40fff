"""The records of one step: what schedule() decided (ScheduleOutput, a Scheduled item per
row), what update() made of its result for each request (Outcome), the engine's step from
its plan to its report (StepInFlight), and the scheduler's counters that the engine and the
admin API read (SchedulerStats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.protocol import StepPlan, StepResult, TokenLogprobs
from service.engine.request import Request

STOP_TOKEN = ("stop", "stop_token")  # a stop_token_ids token finished the sequence
POOLED = ("stop", "pooled")  # a pooled request (an embedding) computed its prompt


@dataclass(slots=True)
class Scheduled:
    request: Request
    num_tokens: int  # of its own tokens (a decode's: 1)
    samples: bool
    start: int = 0  # its first position: the tokens it had computed
    drafts: list[int] = field(default_factory=list)  # drafted tokens it verifies after them
    # a draft model's (Drafted): what it computes first, from position draft_start
    draft_context: list[int] = field(default_factory=list)
    draft_start: int = 0

    @property
    def chunk(self) -> int:
        """Tokens it computes this step, drafts included."""
        return self.num_tokens + len(self.drafts)


@dataclass(slots=True)
class ScheduleOutput:
    iteration: int
    policy: str  # the policy that decided this step
    plan: StepPlan | None
    scheduled: list[Scheduled] = field(default_factory=list)
    written: list[list[int]] = field(default_factory=list)  # each row's blocks it writes
    preempted: list[Request] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)  # scheduled for the first time
    # the rows that compute a prompt (or, after a preemption, prompt and output again)
    chunks: list[Scheduled] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seqs: int = 0
    drafting_seqs: int = 0  # sequences with drafted tokens
    draft_tokens: int = 0  # drafted tokens, over all of them
    accepted_tokens: int = 0  # of those, accepted (known once update() ran)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the step's rows run with, each once, in row order."""
        named = (item.request.params.adapter for item in self.scheduled)
        return tuple(dict.fromkeys(name for name in named if name is not None))

    def sampled_ids(self) -> list[int]:
        """The sequences that sample, in the order of the result's tokens."""
        return [item.request.seq_id for item in self.scheduled if item.samples]


@dataclass(slots=True)
class StepDraft:
    """The step being assembled from one decision."""

    out: ScheduleOutput
    victims: list[Request]  # running sequences the policy offered, under the cap, in order
    chosen: set[int]  # seq_ids already in the step
    budget: int  # tokens still free in the step


@dataclass(slots=True)
class Outcome:
    """What one step did to one request."""

    request: Request
    token: int | None = None  # the sampled token, appended to request.token_ids
    logprobs: TokenLogprobs | None = None  # of the token, if the request asked for them
    finish: tuple[str, str] | None = None  # (reason, detail): finished and freed here
    error: str | None = None


@dataclass(slots=True)
class StepInFlight:
    """One step from its plan to its report (the engine's); with overlap its report comes
    after the next step's plan went out."""

    out: ScheduleOutput
    deadline: float  # engine clock: no result by then means a hung worker
    service_s: float  # service time spent on it: scheduling, then its results
    result: StepResult | None = None
    outcomes: list[Outcome] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    iteration: int  # the last iteration scheduled
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_promised: int  # to admitted sequences still prefilling, not yet allocated
    admission_paused: bool  # since a preemption, until blocks exceed admission_watermark
    kv_blocks_cached: int  # registered in the prefix cache, held or evictable
    kv_blocks_evictable: int  # cached and held by nobody: free, until evicted
    prefix_queries: int  # tokens of the sequences admitted, summed over admissions
    prefix_hits: int  # of those, tokens found in the prefix cache
    kv_blocks_evicted: int  # cached blocks reused for others since the worker started
    draft_tokens: int = 0  # drafted tokens verified since the start (speculative decoding)
    accepted_tokens: int = 0  # of those, accepted
