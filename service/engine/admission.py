"""Admission control: whether a request may join the queue now.

A request is checked (service.engine.validation), then weighed against the queue (too many
sequences or prompt tokens waiting, a predicted TTFT or start past its limits) and against
its tenant's share; it is refused whole, before anything is queued, with InvalidRequest
(400) or Overloaded (429). The engine then makes its sequences and streams
(service.engine.sequences). Submitted requests wait for that verdict in an AdmissionQueue,
which the engine's admission task serves in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import trio

from service.config import Config
from service.engine.request import Request, SamplingParams, Status, account_of
from service.engine.scheduler import Scheduler
from service.engine.validation import InvalidRequest, Limits, validate


class Overloaded(Exception):
    """The queue is full, or the request could not start or answer in time: nothing was
    queued; the caller should retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, reason: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.reason = reason  # queue_full | queued_tokens | predicted_ttft | deadline
        self.retry_after = retry_after


@dataclass(slots=True)
class TenantLoad:
    """A tenant's part of the engine: the quotas' measure, and /metrics'."""

    waiting: int = 0  # sequences not running
    queued_tokens: int = 0  # prompt tokens waiting to start (a prompt once per request)
    kv_blocks: int = 0  # blocks its live sequences may come to hold (prompt + max_tokens)


@dataclass(slots=True)
class Ticket:
    """A request on its way through admission, and the verdict its submitter waits for."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    tenant: str
    priority: int
    received: float
    deadline_s: float | None  # seconds it may wait to start, as the client asked
    n: int  # sequences of the prompt to generate
    trace_headers: dict[str, str] | None = None  # the caller's W3C trace context
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    channel: trio.MemoryReceiveChannel | None = None  # the verdict: a stream, or
    error: Exception | None = None  # why not
    withdrawn: bool = False  # the submitter stopped waiting (cancelled)


class AdmissionQueue:
    """The tickets submitted and not yet judged, at most `max_queue`: the engine's admission
    task judges them in order, one at a time, and each submitter waits for its verdict."""

    def __init__(self, max_queue: int, refused: Callable[[str, str], None]) -> None:
        self._send, self._receive = trio.open_memory_channel[Ticket](max_queue)
        self._refused = refused  # (request id, reason): an Overloaded refusal, reported

    async def submit(
        self, ticket: Ticket, abort: Callable[[str], None]
    ) -> trio.MemoryReceiveChannel:
        """Queue `ticket` and wait for its verdict: its stream, or the error raised. If the
        submitter is cancelled once its request is admitted, `abort` ends the request."""
        try:
            self._send.send_nowait(ticket)
        except trio.WouldBlock:
            self._refused(ticket.request_id, "queue_full")
            raise Overloaded("the admission queue is full; try again later", "queue_full") from None
        try:
            await ticket.done.wait()
        except BaseException:
            ticket.withdrawn = True
            if ticket.channel is not None:  # admitted just before the cancellation reached us
                abort(ticket.request_id)
            raise
        if ticket.error is not None:
            raise ticket.error
        assert ticket.channel is not None
        return ticket.channel

    async def serve(
        self,
        admit: Callable[[Ticket], trio.MemoryReceiveChannel],
        refusals: tuple[type[Exception], ...],
    ) -> None:
        """Forever: each ticket still waited for gets `admit`'s stream, or the refusal (one
        of `refusals`, or Overloaded) it raised."""
        async for ticket in self._receive:
            if not ticket.withdrawn:
                try:
                    ticket.channel = admit(ticket)
                except Overloaded as exc:
                    self._refused(ticket.request_id, exc.reason)
                    ticket.error = exc
                except refusals as exc:
                    ticket.error = exc
            ticket.done.set()

    def refuse_queued(self, error: Exception) -> None:
        """Every ticket still queued gets `error` (the engine stops)."""
        while True:
            try:
                ticket = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            ticket.error = error
            ticket.done.set()


@dataclass(frozen=True, slots=True)
class CacheShape:
    """What the running worker holds: the request limits and its KV cache's blocks."""

    limits: Limits
    num_blocks: int


class AdmissionControl:
    def __init__(self, config: Config, scheduler: Scheduler, requests: dict[str, Request]):
        self.config = config
        self.scheduler = scheduler
        self.requests = requests  # the engine's open streams, by request id

    def check(self, ticket: Ticket, kv: CacheShape) -> float | None:
        """Raises InvalidRequest or Overloaded, or returns the engine-clock deadline by which
        the request must have started (None: no deadline)."""
        params = ticket.params
        validate(
            ticket.prompt_token_ids,
            params,
            kv.limits,
            ticket.tenant,
            ticket.priority,
            sequences=ticket.n,
            deadline_s=ticket.deadline_s,
        )
        deadline = self._deadline_of(ticket)
        prompt_len = len(ticket.prompt_token_ids)
        self._shed_if_overloaded(prompt_len, deadline, ticket.n, kv.limits.max_model_len)
        assert params.max_tokens is not None  # validation fills it
        self._enforce_tenant_quota(ticket, params.max_tokens, kv)
        return deadline

    def _deadline_of(self, ticket: Ticket) -> float | None:
        waits = [w for w in (ticket.deadline_s, self.config.max_queue_time) if w is not None]
        return ticket.received + min(waits) if waits else None

    def _shed_if_overloaded(
        self, prompt_len: int, deadline: float | None, sequences: int, max_model_len: int
    ) -> None:
        """Refuse at arrival, in milliseconds, what the queue cannot take or cannot serve in
        time: too many sequences or prompt tokens waiting, a predicted TTFT over
        --max-predicted-ttft, or a predicted start after the request's deadline. A request's
        n sequences all take a place in the queue (the held ones too); its prompt counts
        once, since the later ones find it in the prefix cache."""
        sched = self.scheduler
        waiting = sched.queued_sequences()
        if waiting + sequences > self.config.max_queue:
            raise Overloaded(f"{waiting} sequences are waiting; try again later", "queue_full")
        queued = sum(r.remaining for r in sched.waiting)  # to compute before they sample
        if queued + prompt_len > max(self.config.max_queued_tokens, max_model_len):
            raise Overloaded(
                f"{queued} prompt tokens are waiting; try again later", "queued_tokens"
            )
        target = self.config.max_predicted_ttft
        if target is None and deadline is None:
            return
        ahead_ms = predicted_prefill_ms(sched)
        if ahead_ms is None:
            return  # no step measured yet: nothing to predict from
        if target is not None:
            ttft_ms = predicted_prefill_ms(sched, prompt_len) or 0.0
            if ttft_ms > target * 1000:
                raise Overloaded(
                    f"its predicted time to first token, {ttft_ms / 1000:.1f} s, exceeds "
                    f"the server's {target:g} s",
                    "predicted_ttft",
                    retry_after=ttft_ms / 1000 - target,
                )
        now = trio.current_time()
        if deadline is not None and now + ahead_ms / 1000 > deadline:
            raise Overloaded(
                f"it could start in {ahead_ms / 1000:.1f} s at the earliest, after its "
                f"deadline ({deadline - now:.1f} s)",
                "deadline",
                retry_after=now + ahead_ms / 1000 - deadline,
            )

    def tenant_load(self) -> dict[str, TenantLoad]:
        """What each tenant has in the engine now (a scan: its requests are few thousand at
        most, bounded by --max-queue and --max-num-seqs)."""
        loads: dict[str, TenantLoad] = {}
        to_hold = self.scheduler.blocks.blocks_to_hold  # in every KV group
        for request in self.requests.values():
            load = loads.setdefault(account_of(request.tenant), TenantLoad())
            assert request.params.max_tokens is not None
            load.kv_blocks += to_hold(request.prompt_len + request.params.max_tokens)
            if request.status is Status.WAITING:
                load.waiting += 1
                load.queued_tokens += request.prompt_len if request.index == 0 else 0
        return loads

    def _enforce_tenant_quota(self, ticket: Ticket, max_tokens: int, kv: CacheShape) -> None:
        """One tenant may take its share of the queue and of the KV blocks, so that its
        flood leaves the rest to others; each of its n sequences counts in full."""
        share = self.config.tenant_share()
        if share >= 1:
            return
        account = account_of(ticket.tenant)
        to_hold = self.scheduler.blocks.blocks_to_hold(len(ticket.prompt_token_ids) + max_tokens)
        blocks = ticket.n * to_hold
        kv_quota = int(share * kv.num_blocks)
        if blocks > kv_quota:
            raise InvalidRequest(
                f"n x (prompt + max_tokens) needs {blocks} KV blocks, more than a tenant's "
                f"{kv_quota}; ask for fewer sequences or tokens",
                "n",
                "tenant_quota_exceeded",
            )
        load = self.tenant_load().get(account, TenantLoad())
        checks = (
            (load.waiting + ticket.n, self.config.max_queue, "sequences waiting", "queue_full"),
            (
                load.queued_tokens + len(ticket.prompt_token_ids),
                max(self.config.max_queued_tokens, kv.limits.max_model_len),
                "prompt tokens waiting",
                "queued_tokens",
            ),
            (load.kv_blocks + blocks, kv.num_blocks, "KV blocks", "kv_blocks"),
        )
        for wanted, limit, what, reason in checks:
            if wanted > share * limit:
                raise Overloaded(
                    f"tenant {account!r} would have {wanted} {what}, more than its share "
                    f"({int(share * limit)}); try again later",
                    f"tenant_{reason}",
                )


def predicted_prefill_ms(sched: Scheduler, new_prompt: int = 0) -> float | None:
    """How long the prefill now pending (running prompts' rest, then the waiting) and a
    new prompt of `new_prompt` tokens would take at the measured step costs; None until
    the cost model is fitted. Chunking changes neither a prompt's tokens nor its
    attention pairs, only the number of steps, each of which also carries the decodes."""
    cost = sched.step_cost.estimate()
    if cost is None:
        return None
    decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens <= 1]
    prefilling = [r for r in sched.running if r.num_tokens - r.num_computed_tokens > 1]
    prefills = [*prefilling, *sched.waiting]
    work_ms = cost.chunk_ms(0, new_prompt) if new_prompt else 0.0
    work_ms += sum(cost.chunk_ms(r.num_computed_tokens, r.remaining) for r in prefills)
    tokens = new_prompt + sum(r.remaining for r in prefills)
    step_ms = cost.decode_ms([r.num_computed_tokens for r in decoding])
    steps = -(-tokens // max(1, sched.max_batched_tokens - len(decoding)))
    return work_ms + steps * step_ms
