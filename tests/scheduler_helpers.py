"""Building blocks for tests of the Scheduler alone: a policy that returns whatever a test
scripts, requests in any state, and the worker's answer to a step."""

from __future__ import annotations

import trio

from gpu_worker.protocol import StepResult
from policies.base import Decision, Policy, View
from service.engine.block_manager import BlockManager
from service.engine.detokenizer import Detokenizer
from service.engine.request import Request, SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.speculation import SpeculativeConfig, Speculator
from service.engine.step import ScheduleOutput
from tests.sim_worker import EOS, SimTokenizer

SAMPLED = 7  # the token every simulated step samples


class Scripted(Policy):
    """Returns whatever the test sets, however wrong."""

    name = "scripted"
    summary = "test"

    def __init__(self) -> None:
        super().__init__(None)
        self.next = Decision()
        self.views: list[View] = []

    def decide(self, view: View) -> Decision:
        self.views.append(view)
        return self.next


def make_request(
    seq_id: int,
    prompt_len: int,
    *,
    max_tokens: int = 8,
    tenant: str = "t",
    priority: int = 0,
    received: float | None = None,
    family: int | None = None,
    pattern: list[int] | None = None,
) -> Request:
    """Requests of one `family` (default: its own) share their prompts' prefixes; with a
    `pattern`, the prompt repeats it (n-gram drafting finds it)."""
    send, _ = trio.open_memory_channel(1000)
    first = (seq_id if family is None else family) * 31
    prompt = [(first + i) % 250 for i in range(prompt_len)]
    if pattern is not None:
        prompt = [pattern[i % len(pattern)] for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens)
    return Request(
        request_id=f"r{seq_id}",
        seq_id=seq_id,
        prompt_len=prompt_len,
        token_ids=list(prompt),
        params=params,
        tenant=tenant,
        priority=priority,
        received=float(seq_id) if received is None else received,
        stream=send,
        detokenizer=Detokenizer(SimTokenizer(), prompt, []),
    )


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_tokens: int = 32,
    max_seqs: int = 4,
    watermark: float = 0.0,
    *,
    admission_watermark: float = 0.0,
    max_preemptions: int = 3,
    prefix_caching: bool = False,
    tenant_share: float = 1.0,
    speculative: SpeculativeConfig | None = None,
) -> tuple[Scheduler, Scripted]:
    policy = Scripted()
    sched = Scheduler(
        BlockManager(num_blocks, block_size, watermark, enable_caching=prefix_caching),
        policy,
        max_batched_tokens=max_tokens,
        max_num_seqs=max_seqs,
        eos_token_ids=[EOS],
        max_preemptions=max_preemptions,
        admission_watermark=admission_watermark,
        tenant_share=tenant_share,
        speculator=None if speculative is None else Speculator(speculative),
    )
    return sched, policy


def sampled_result(out: ScheduleOutput, step_ms: float = 0.0) -> StepResult:
    """What the worker answers: SAMPLED for every sequence of the step that samples."""
    seq_ids = [item.request.seq_id for item in out.scheduled if item.samples]
    return StepResult(out.iteration, seq_ids, [[SAMPLED]] * len(seq_ids), step_ms=step_ms)
