"""The engine: an admission task and a scheduling task in one trio nursery, and the worker.

Admission validates each request, bounds the queue, makes its sequences
(service.engine.sequences) and hands them to the scheduler. The scheduling task runs
iterations: `Scheduler.schedule()` -> worker step -> `Scheduler.update()`, then the
engine's own part: text (detokenizer, stop strings), stream events, observers. The
worker's life (start, idle watch, restarts) is its Supervisor's (supervision.py). The
front end talks to it only through submit() (a stream of events) and abort().

Overlap (Config.overlap: "on", "off", or "auto": on, except that where the worker computes
on the CPU only a step of at most CPU_OVERLAP_SEQS sequences overlaps): as soon as result k
is in and update() has committed its tokens, step k+1 is scheduled and sent, and step k's
own part runs while the worker computes k+1. On 2 vCPUs a full batch's part took cores the
worker's compute needed (W1 1-2 % slower), while a lone stream's step waited about 2 ms
less for the service (one int8 stream: 77.6 against 70.4 tokens/s). The loop is the same
without overlap; only that part moves back to before the next schedule(). Outputs stay
token-exact because:
- update() appends every sampled token, and ends EOS and max_tokens sequences (freeing
  their blocks), before the next schedule(); only stop strings are found later. So the
  drafts of step k+1 (speculative decoding) are drawn from every token step k took: they
  need no sequential loop.
- A request that ends while it is in the plan in flight (a stop string found in step k's
  part, an abort at any await) is computed once more for nothing: update() skips finished
  requests (no progress, no token) and _emit sends nothing for them.
- Its blocks, freed when it ends, are allocated again only by schedule(), which runs after
  result k+1 is in: at most one plan is in flight, so the worker is done with every block
  of plan k+1 before another plan may use it (debug_invariants checks it).
- A step's outcomes go out before anything fails its requests (a dead or hung worker,
  shutdown), so no computed token is lost; an output never depends on its batch.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from gpu_worker.protocol import BLOCK_SIZE, Handshake
from policies.registry import make_policy
from service.config import Config
from service.engine import trace_context
from service.engine.adapters import AdapterSlots
from service.engine.admission import (
    AdmissionControl,
    AdmissionQueue,
    CacheShape,
    TenantLoad,
    Ticket,
)
from service.engine.block_manager import BlockManager
from service.engine.detokenizer import Delta
from service.engine.engine_state import (
    kv_cache_state,
    prefix_cache_state,
    speculative_state,
    step_cost_state,
)
from service.engine.invariants import check_blocks_kept, check_invariants
from service.engine.kv_transfer import (
    KV_TRANSFER_FAILED,
    ROLE_BOTH,
    ROLE_PRODUCER,
    Fingerprint,
    KvHolds,
    StagingArena,
    check_kv_transfer,
    producer_params,
)
from service.engine.masks import MaskFiller, unmasked, waits_for_masks
from service.engine.reporting import Reporter
from service.engine.request import FinishEvent, Request, SamplingParams, Status, TokenEvent
from service.engine.sampling import worker_sampling
from service.engine.scheduler import Scheduler
from service.engine.sequences import Sequences, TokenizerLike, sequence_ids
from service.engine.speculation import Speculator
from service.engine.stats import Observer
from service.engine.step import POOLED, STOP_TOKEN, Outcome, StepInFlight
from service.engine.supervision import Supervisor, Worker
from service.engine.validation import InvalidRequest, Limits
from service.engine.worker_link import WorkerDied, WorkerHung, WorkerStartError

log = structlog.get_logger()
# With Config.overlap "auto" and the worker on the CPU, the most sequences a step may have
# and overlap (module docstring)
CPU_OVERLAP_SEQS = 4
# While nothing computes, how often a rowless step asks the worker how K/V transfers are
# going: a consumer's pulls (a request waits for each), or only a producer's holds (their
# notices free blocks, which no request waits for)
PULL_POLL_S, HOLD_POLL_S = 0.005, 0.05


class EngineUnavailable(Exception):
    """The worker is not ready, restarting, or the engine is shutting down (HTTP 503)."""


class EngineFailed(RuntimeError):
    """The worker could not be restarted `max_worker_restarts` times in a row: the engine
    stops (a server exits 1, so that its supervisor can start it afresh)."""


@dataclass(slots=True)
class PolicySwap:
    old: dict
    new: dict
    iteration: int  # the first iteration the new policy decides


class Engine:
    def __init__(self, config: Config, worker: Worker, tokenizer: TokenizerLike) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.handshake: Handshake | None = None
        self._worker = worker
        self._supervisor = Supervisor(
            worker,
            step_timeout=config.step_timeout,
            max_restarts=config.max_worker_restarts,
            on_started=self._worker_started,
        )
        spec = config.speculative_config
        # built now, given its blocks at each worker start (none before the first)
        self._scheduler = Scheduler(
            self._blocks_for(None),
            make_policy(config.policy, config.policy_params),
            max_batched_tokens=config.max_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            eos_token_ids=tokenizer.eos_token_ids,
            max_preemptions=config.max_preemptions,
            admission_watermark=config.admission_watermark,
            tenant_share=config.tenant_share(),
            speculator=None if spec is None else Speculator(spec),
        )
        if config.kv_transfer_role in (ROLE_PRODUCER, ROLE_BOTH):
            holds = KvHolds(config.kv_hold_timeout, config.kv_transfer_timeout)
            self._scheduler.kv_holds = holds
            self._scheduler.kv_staging = StagingArena()  # its blocks: the worker's handshake
        if config.enable_lora:
            self._scheduler.adapter_slots = AdapterSlots(config.max_loras)
        self.engine_id = uuid.uuid4().hex  # vLLM's remote_engine_id of a producer's answers
        self._requests: dict[str, Request] = {}  # open streams, by request id
        self._admission = AdmissionControl(config, self._scheduler, self._requests)
        self._sequences = Sequences(tokenizer, config.max_stream_buffer_bytes)
        self._report = Reporter(config.log_iterations)
        self._queue = AdmissionQueue(config.max_queue, self._report.refused)
        self._wakeup = trio.Event()
        self._masks = MaskFiller(config.grammar_mask_wait_ms / 1000)
        self._all_done = trio.Event()
        self._ready = False
        # the most sequences a step may have and overlap: decided when a worker starts
        # (Config.overlap, its device); 0: none does
        self._overlap_seqs = 0
        self._accepting = True
        self._unemitted: StepInFlight | None = None  # its tokens are committed, not yet sent out
        self._stopped = trio.Event()
        self.failure: EngineFailed | None = None  # why the engine stopped on its own

    # ---- public API -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def max_model_len(self) -> int | None:
        """Prompt + completion tokens one request may have: the model's window, or less."""
        if self.handshake is None:
            return None
        window, cap = self.handshake.max_model_len, self.config.max_model_len
        return window if cap is None else min(cap, window)

    @property
    def last_worker_failure(self) -> dict[str, Any] | None:
        """Why the worker was last replaced: {"reason", "error", "at" (Unix seconds)}."""
        return self._supervisor.last_failure

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def add_observer(self, observer: Observer) -> None:
        self._report.observers.append(observer)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start the worker (its failure raises), then serve until cancelled, or until the
        worker cannot be restarted: then `failure` is set and run returns, so that a server
        can end its connections gracefully before it exits."""
        try:
            await self._supervisor.start()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    self._queue.serve, self._admit, (InvalidRequest, EngineUnavailable)
                )
                nursery.start_soon(self._scheduling_task)
                nursery.start_soon(self._mask_task)
                task_status.started()
        except* EngineFailed as failed:
            first = failed.exceptions[0]
            self.failure = first if isinstance(first, EngineFailed) else EngineFailed(str(first))
            log.error("engine.failed", error=str(self.failure))
        finally:
            self._ready = False
            self._accepting = False
            self._queue.refuse_queued(EngineUnavailable("the engine is shutting down"))
            self._finish_all("abort", "shutdown")
            await self._supervisor.stop()
            self._stopped.set()

    async def wait_stopped(self) -> None:
        """Return once `run` has ended (see `failure` for why)."""
        await self._stopped.wait()

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        tenant: str = "default",
        priority: int = 0,
        deadline_s: float | None = None,
        n: int = 1,
    ) -> trio.MemoryReceiveChannel:
        """Queue a request; its channel yields TokenEvent* then one FinishEvent, then closes.

        `n` > 1: n sequences of the one prompt (`request_id`, then `request_id-1`, ...), whose
        events share the channel, each with its sequence's `index`; it closes after the last
        FinishEvent. A seeded request's sequence i samples with seed + i. `abort(request_id)`
        ends them all.

        `deadline_s`: seconds it may wait to start (the server's --max-queue-time bounds it
        too); not started by then, it finishes with ("error", "deadline_exceeded").
        The caller's trace context, if it set one (service.engine.trace_context), goes with it.
        Raises InvalidRequest, Overloaded or EngineUnavailable, and then nothing was queued.
        """
        if not self._accepting or not self._ready:
            raise EngineUnavailable("the engine is not ready (starting, restarting or stopping)")
        params = dataclasses.replace(params)  # validation fills a missing max_tokens
        ticket = Ticket(
            list(prompt_token_ids),
            params,
            request_id,
            tenant,
            priority,
            trio.current_time(),
            deadline_s,
            n,
            trace_context.current.get(),
        )
        return await self._queue.submit(ticket, self.abort)

    def abort(self, request_id: str) -> None:
        """End a request, all its n sequences, now (synchronous, idempotent); its blocks
        are free at once."""
        group: Sequence[Request | None] = self._sequences.group(request_id) or [
            self._requests.get(request_id)
        ]
        for request in group:
            if request is not None and not request.is_finished:
                self._emit_committed(request)
                self._finish(request, "abort", "aborted")
                self._wakeup.set()  # freed blocks may let a stuck admission through

    def set_policy(self, name: str, params: dict | None, *, by: str = "api") -> PolicySwap:
        """Swap the policy at the next iteration boundary; PolicyError changes nothing."""
        new = make_policy(name, params)
        old = self.policy_info()
        iteration = self._scheduler.set_policy(new)
        swap = PolicySwap(old=old, new=new.describe(), iteration=iteration)
        self._report.policy_swap(old, swap.new, iteration, by)
        return swap

    def policy_info(self) -> dict:
        """The policy that decides the next iteration: {"name", "params"}."""
        return self._scheduler.next_policy.describe()

    def state(self) -> dict:
        stats = self._scheduler.stats()
        return {
            "waiting": stats.waiting,
            "running": stats.running,
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_total": stats.kv_blocks_total,
            "kv_blocks_promised": stats.kv_blocks_promised,
            "admission_paused": stats.admission_paused,
            "corrections": dict(self._scheduler.corrections),
            "adapter_slots": slots.held() if (slots := self._scheduler.adapter_slots) else None,
            "policy": self.policy_info(),
            "iteration": stats.iteration,
            "worker_ready": self._ready,
            "worker_restarts": self._supervisor.restarts,
            "last_worker_failure": self.last_worker_failure,
            "max_model_len": self.max_model_len,
            "kv_cache": kv_cache_state(self.handshake),
            "overlap": {"setting": self.config.overlap, "max_seqs": self._overlap_limit()},
            "step_cost": step_cost_state(self._scheduler.step_cost),
            "prefix_cache": prefix_cache_state(self._prefix_caching(self.handshake), stats),
            "speculative": speculative_state(
                self.config.speculative_config, self._scheduler.speculator, stats
            ),
            "kv_transfer": self._kv_transfer_state(),
        }

    def _kv_transfer_state(self) -> dict[str, Any] | None:
        """A producer's holds and a consumer's pulls now; None without a role."""
        if self.config.kv_transfer_role is None:
            return None
        sched = self._scheduler
        holds = sched.kv_holds.state() if sched.kv_holds is not None else None
        staging = sched.kv_staging.state() if sched.kv_staging is not None else None
        pulls = {"waiting": len(sched.kv_pulls.waiting), "pulling": len(sched.kv_pulls.pulling)}
        role = self.config.kv_transfer_role
        kept = sched.kv_holds.kept if sched.kv_holds is not None else None
        state = {"role": role, "holds": holds, "holds_kept": kept, "staging": staging}
        return {**state, "pulls": pulls}

    def _overlap_limit(self) -> int | None:
        """The most sequences a step may have and overlap; None: every step does."""
        return None if self._overlap_seqs == sys.maxsize else self._overlap_seqs

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix now; returns how many blocks were cached."""
        return self._scheduler.reset_prefix_cache()

    def begin_shutdown(self) -> None:
        self._accepting = False

    async def drain(self, timeout: float) -> None:
        """Let in-flight requests finish for up to `timeout` s, then abort the rest."""
        with trio.move_on_after(timeout):
            while self._requests:
                await self._all_done.wait()
        self._finish_all("abort", "shutdown")

    # ---- admission --------------------------------------------------------------------

    def _admit(self, ticket: Ticket) -> trio.MemoryReceiveChannel:
        """Validate, bound the queue, hand over to the scheduler; raises and queues nothing."""
        if not self._accepting:
            raise EngineUnavailable("the engine is shutting down")
        # checked first: nothing is sized by `n` before validation bounds it (the offline
        # API reaches here without the HTTP layer's bounds)
        deadline = self._admission.check(ticket, self._cache_shape())
        assert self.handshake is not None  # checked by _cache_shape
        check_kv_transfer(
            ticket.params,
            len(ticket.prompt_token_ids),
            ticket.n,
            self.config.kv_transfer_role,
            self.handshake,
        )
        ids = sequence_ids(ticket.request_id, ticket.n)
        if any(request_id in self._requests for request_id in ids):
            raise InvalidRequest(
                f"request id {ticket.request_id!r} is already in use", code="duplicate_id"
            )
        params = worker_sampling(ticket.params, self.tokenizer.encode, self.tokenizer.eos_token_ids)
        made, receive = self._sequences.make(ticket, params, deadline)
        for request in made:
            self._requests[request.request_id] = request
            self._report.received(request, ticket.n)
        self._all_done = trio.Event()
        sched, (leader, *siblings) = self._scheduler, made
        if siblings and self._prefix_caching(self.handshake):
            sched.hold(leader, siblings)  # until it has computed the prompt they share
        else:
            for sibling in siblings:
                sched.add(sibling)
        sched.add(leader)
        self._wakeup.set()
        return receive

    def _release_siblings(self, leader: Request) -> None:
        """The leader computed its prompt (or ended): its held siblings may start."""
        if self._scheduler.release_held(leader):
            self._wakeup.set()

    def _expire_deadlines(self, now: float) -> None:
        """Requests whose deadline passed before they started end now, exactly once."""
        for request in self._scheduler.expired(now):
            assert request.deadline is not None  # only requests with one expire
            waited = request.deadline - request.received
            message = f"the request did not start within its {waited:g} s deadline"
            self._report.refused(request.request_id, "deadline_exceeded")
            self._finish(request, "error", "deadline_exceeded", error=message)

    def _end_overdue_pulls(self, now: float) -> None:
        """A pull that takes longer than --kv-transfer-timeout fails its request (never
        recomputed); the blocks wait for the worker's word that the pull is done."""
        timeout = self.config.kv_transfer_timeout
        for request in self._scheduler.overdue_pulls(now, timeout):
            message = f"pulling the prompt's K/V took longer than {timeout:g} s"
            self._finish(request, "error", KV_TRANSFER_FAILED, error=message)

    def tenant_load(self) -> dict[str, TenantLoad]:
        """What each tenant has in the engine now: its quotas' measure (/metrics shows it)."""
        return self._admission.tenant_load()

    def _cache_shape(self) -> CacheShape:
        assert self.handshake is not None and self.max_model_len is not None
        limits = Limits(
            vocab_size=self.handshake.vocab_size,
            max_model_len=self.max_model_len,
            kv_capacity_tokens=self._scheduler.capacity_tokens,
        )
        return CacheShape(limits, self.handshake.num_blocks)

    # ---- the iteration ----------------------------------------------------------------

    async def _scheduling_task(self) -> None:
        sched = self._scheduler
        while True:
            self._expire_deadlines(trio.current_time())
            self._end_overdue_pulls(trio.current_time())
            try:
                if not await self._iterate(sched):
                    # nothing to do, or nothing could be scheduled: wait for a request or an abort
                    await self._wait_for_work()
                elif sched.transfers_pending and not sched.running:
                    await self._pause_for_transfers()
            except WorkerDied as exc:
                await self._recover(exc)

    async def _mask_task(self) -> None:
        sched = self._scheduler
        await self._masks.run(
            lambda: unmasked(sched.constrained, sched.max_num_seqs),
            lambda: self._wakeup.set(),
            self._fail_masks,
        )

    def _fail_masks(self, requests: list[Request], error: str) -> None:
        for request in requests:
            self._finish(request, "error", "grammar_error", error)

    async def _pause_for_transfers(self) -> None:
        """Only K/V is moving: the next rowless step a little later, or at a request."""
        self._wakeup = trio.Event()
        sched = self._scheduler
        with trio.move_on_after(PULL_POLL_S if sched.kv_pulls.pulling else HOLD_POLL_S):
            await self._wakeup.wait()

    async def _wait_for_work(self) -> None:
        """Sleep until woken (a request, an abort), the idle worker watched meanwhile."""
        self._wakeup = trio.Event()
        await self._supervisor.sleep_until(self._wakeup)

    async def _iterate(self, sched: Scheduler) -> bool:
        """Send the next step; run the previous step's part (text, events, report), after
        the send when overlapping; take the new step's result. False: nothing to do."""
        try:
            step = await self._send_next_step(sched)
        finally:
            emitted = self._emit_unemitted(sched)  # valid tokens, whatever became of the send
        if step is None:
            return emitted  # a stop string it found may have freed blocks for a schedule
        await self._take_result(sched, step)
        assert step.out.plan is not None
        if len(step.out.plan.seq_ids) > self._overlap_seqs:
            self._emit_unemitted(sched)
        return True

    async def _send_next_step(self, sched: Scheduler) -> StepInFlight | None:
        """Schedule a step and hand its plan to the worker; None if nothing can run."""
        self._masks.worker_waits()  # no plan is in flight here
        if not sched.has_work():
            return None
        await self._masks.settle(lambda: waits_for_masks(sched.constrained))
        started = time.perf_counter()
        out = sched.schedule(trio.current_time())
        self._report.scheduled(out, trio.current_time())
        if out.plan is None:
            return None
        deadline = trio.current_time() + self.config.step_timeout
        step = StepInFlight(out, deadline, service_s=time.perf_counter() - started)
        self._masks.worker_computes()
        with trio.move_on_at(deadline):
            await self._worker.send_step(out.plan)
            return step
        raise WorkerHung(f"the worker took no plan for {self.config.step_timeout} s")

    async def _take_result(self, sched: Scheduler, step: StepInFlight) -> None:
        """Wait for the step's result and apply it: its tokens are committed from here."""
        assert step.out.plan is not None
        result = None
        with trio.move_on_at(step.deadline):
            result = await self._worker.receive_result(step.out.plan.step_id)
            self._masks.worker_waits()
        if result is None:
            raise WorkerHung(f"a step took longer than {self.config.step_timeout} s")
        plan = step.out.plan
        if result.error is None and result.seq_ids != plan.sampled_ids:
            raise WorkerDied("the worker's result does not answer its plan's sampling sequences")
        started = time.perf_counter()
        if self.config.debug_invariants:
            check_blocks_kept(sched, step.out)
        step.result = result
        step.outcomes = sched.update(step.out, result)
        self._masks.kick()  # the next masks fill while this step's text goes out
        step.service_s += time.perf_counter() - started
        self._unemitted = step

    def _emit_unemitted(self, sched: Scheduler) -> bool:
        """The engine's part of the step whose result was applied last; False if none."""
        step, self._unemitted = self._unemitted, None
        if step is None:
            return False
        started = time.perf_counter()
        now = trio.current_time()
        for outcome in step.outcomes:
            self._emit(outcome, now)
        if self.config.debug_invariants:
            check_invariants(sched)
        step.service_s += time.perf_counter() - started
        assert step.result is not None
        if step.out.scheduled:  # a rowless step only asked after K/V transfers
            self._report.iteration(step.out, step.result, sched.stats(), step.service_s)
        return True

    def _emit_committed(self, request: Request) -> None:
        """Before ending a request from outside the loop (abort, shutdown): the tokens that
        update() committed for it and the overlapped loop has not sent yet go out first, as
        they would have without overlap."""
        step = self._unemitted
        for outcome in step.outcomes if step else ():
            if outcome.request is request:
                self._emit(outcome, trio.current_time())

    def _emit(self, outcome: Outcome, now: float) -> None:
        """Text and events for one request's share of a step; finish it if it is done."""
        request, finish = outcome.request, outcome.finish
        if request.is_finished:
            return  # already ended: by an abort, after its committed tokens went out
        if outcome.token is None:
            assert finish is not None
            self._finish(request, *finish, error=outcome.error)
            return
        request.token_times.append(now)
        event = TokenEvent("", [outcome.token], outcome.logprobs, index=request.index)
        if request.first_token is None:
            request.first_token = now
            event.prompt_logprobs = request.prompt_logprobs
            self._release_siblings(request)
            self._report.first_token(request, now)
        # as vLLM: a stop token's text is not the output's
        stop_token = finish == STOP_TOKEN
        delta = Delta("", False) if stop_token else request.detokenizer.add_token(outcome.token)
        text = delta.text
        if delta.stopped:
            finish = ("stop", "stop_string")
            request.drop_unsent()
        elif finish is not None:
            text += request.detokenizer.flush()
        event.text = text
        if not request.send(event):
            self._end_slow_reader(request)
        elif finish is not None:
            self._finish(request, *finish)

    def _end_slow_reader(self, request: Request) -> None:
        """Its reader left --max-stream-buffer-bytes unread: end every sequence of the
        stream, so that the server holds no more for it (the reader gets the error last)."""
        limit = self.config.max_stream_buffer_bytes
        error = f"the client left more than {limit} bytes of this stream unread"
        for member in self._sequences.members(request):
            self._finish(member, "error", "slow_reader", error)

    def _finish(self, request: Request, reason: str, detail: str, error: str | None = None) -> None:
        if request.is_finished:
            return
        self._scheduler.remove(request)
        request.status = Status.FINISHED
        request.finished = trio.current_time()
        request.finish_reason, request.finish_detail = reason, detail
        completion = request.num_generated
        cached = request.num_cached_tokens
        event = FinishEvent(
            reason, detail, request.prompt_len, completion, error, cached, request.index
        )
        event.phases = request.phases
        if (reason, detail) == POOLED:
            event.embedding = request.pooled
        elif detail == "stop_string":
            event.stop_string = request.detokenizer.stopped_by
        if request.kv_hold is not None and self.handshake is not None:
            fingerprint = Fingerprint.of(self.handshake)
            hold, now = request.kv_hold, trio.current_time()
            params = producer_params(hold, self.handshake, self.engine_id, fingerprint, now)
            event.kv_transfer_params = params
        request.send(event)
        request.stream.close()
        self._requests.pop(request.request_id, None)
        self._release_siblings(request)
        self._sequences.finished(request)
        if not self._requests:
            self._all_done.set()
        self._report.finished(request, self._scheduler.policy.name, self._scheduler.iteration)

    def _finish_all(self, reason: str, detail: str) -> None:
        for request in list(self._requests.values()):
            self._emit_committed(request)
            self._finish(request, reason, detail)

    # ---- worker supervision -----------------------------------------------------------

    def _worker_started(self, handshake: Handshake) -> None:
        """A new worker's cache sizes the blocks; its device decides overlap and masks.
        WorkerStartError where its model cannot serve what the server was asked to."""
        refuse_what_a_recurrent_state_cannot(handshake, self.config)
        self.handshake = handshake
        self._scheduler.replace_blocks(self._blocks_for(handshake))
        if self._scheduler.kv_staging is not None:
            self._scheduler.kv_staging.reset(handshake.kv_staging_blocks)
        self._fail_what_no_longer_fits()
        self._overlap_seqs = overlap_seqs(self.config.overlap, handshake.device)
        # on the CPU, fills would take the cores the step needs: only between steps there
        self._masks.beside_step = not handshake.device.startswith("cpu")
        self._ready = True
        self._report.worker_started(handshake, self._overlap_limit())

    def _blocks_for(self, handshake: Handshake | None) -> BlockManager:
        """The KV cache's block ids, in the block size and KV groups of the worker's cache
        (none before a worker answers)."""
        return BlockManager(
            0 if handshake is None else handshake.num_blocks,
            BLOCK_SIZE if handshake is None else handshake.block_size,  # no blocks before
            self.config.watermark,
            enable_caching=self._prefix_caching(handshake),
            windows=(None,) if handshake is None else handshake.kv_group_windows,
            max_chunk_tokens=self.config.max_batched_tokens,
        )

    def _prefix_caching(self, handshake: Handshake | None) -> bool:
        """Whether prompts share cached blocks: as configured, except for a model whose
        layers keep a recurrent state (Qwen3-Next, Qwen3.5): a hit would skip the tokens
        that state was computed from, and no state is kept per block (README: Models)."""
        recurrent = handshake is not None and handshake.recurrent_state_bytes > 0
        return self.config.enable_prefix_caching and not recurrent

    def _fail_what_no_longer_fits(self) -> None:
        """A restarted worker may have a smaller KV cache (free device memory changed):
        a waiting request admitted under the old size that cannot fit now would wait forever."""
        assert self.max_model_len is not None
        capacity = min(self._scheduler.capacity_tokens, self.max_model_len)
        for request in list(self._scheduler.waiting):
            needed = request.prompt_len + (request.params.max_tokens or 0)
            if needed > capacity:
                message = (
                    f"the restarted worker holds at most {capacity} tokens for one request; "
                    f"this one needs {needed}"
                )
                self._finish(request, "error", "kv_capacity_exceeded", error=message)

    async def _recover(self, exc: WorkerDied) -> None:
        """Fail what was running, keep what was waiting, restart the worker; after
        `max_worker_restarts` failed starts in a row fail the waiting too and raise EngineFailed."""
        self._ready = False
        sched = self._scheduler
        failure = await self._supervisor.put_down(exc, running=len(sched.running))
        for request in [*sched.running, *sched.transferring]:
            self._finish(request, "error", failure.detail, error=failure.error)
        if await self._supervisor.restart():
            return
        for request in list(sched.waiting):
            self._finish(
                request, "error", "worker_unavailable", error="the model worker cannot be restarted"
            )
        raise EngineFailed(f"the worker failed to start {self.config.max_worker_restarts} times")


def refuse_what_a_recurrent_state_cannot(handshake: Handshake, config: Config) -> None:
    """Speculative decoding verifies drafts by computing them; a rejected draft's tokens
    would stay in a recurrent state, which cannot be rolled back as KV slots can."""
    if handshake.recurrent_state_bytes and config.speculative_config is not None:
        raise WorkerStartError(
            f"{handshake.architecture} keeps a recurrent state per sequence (linear-attention "
            "layers), which a rejected draft cannot be taken back from: speculative decoding "
            "is not served for it; drop --speculative-config"
        )


def overlap_seqs(setting: str, device: str) -> int:
    """The most sequences a step may have and overlap: every step "on", none "off"; with
    "auto" every step unless the worker's device is the CPU, where only small ones do
    (module docstring)."""
    if setting == "off":
        return 0
    if setting == "auto" and device.startswith("cpu"):
        return CPU_OVERLAP_SEQS
    return sys.maxsize
