"""The engine: admission, the scheduler loop and worker supervision in one trio nursery.

Each iteration: view -> policy decision -> core validation -> BatchPlan -> worker.step ->
append tokens, detokenize, stop checks, stream events -> retire finished sequences. The
front end talks to it only through submit() (a stream of events) and abort().
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from gpu_worker.protocol import BatchPlan, Handshake, StepResult
from policies.base import Policy
from policies.registry import make_policy
from service.config import Config
from service.engine.block_manager import BlockManager
from service.engine.detokenizer import Detokenizer
from service.engine.request import (
    FinishEvent,
    Request,
    SamplingParams,
    Status,
    TokenEvent,
    sampling_spec,
)
from service.engine.scheduler import ScheduleOutput, Scheduler
from service.engine.stats import IterationStats, Observer, RequestStats
from service.engine.worker_link import WorkerDied

log = structlog.get_logger()

_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
_WORKER_STOP_TIMEOUT_S = 10.0


class Overloaded(Exception):
    """The admission queue is full; the caller should retry later (HTTP 429)."""


class EngineUnavailable(Exception):
    """The worker is not ready, restarting, or the engine is shutting down (HTTP 503)."""


class InvalidRequest(ValueError):
    """A request the engine cannot serve; the message is meant for the user (HTTP 400)."""


@dataclass(slots=True)
class PolicySwap:
    old: dict
    new: dict
    iteration: int  # the first iteration the new policy decides


class Engine:
    def __init__(self, config: Config, worker: Any, tokenizer: Any) -> None:
        self.config = config
        self.handshake: Handshake | None = None
        self._worker = worker
        self._tokenizer = tokenizer
        self._policy: Policy = make_policy(config.policy, config.policy_params)
        self._pending_policy: Policy | None = None
        self._scheduler: Scheduler | None = None
        self._requests: dict[str, Request] = {}
        self._observers: list[Observer] = []
        self._admit_send, self._admit_recv = trio.open_memory_channel[Request](config.max_queue)
        self._wakeup = trio.Event()
        self._all_done = trio.Event()
        self._ready = False
        self._accepting = True
        self._eos: frozenset[int] = frozenset()
        self._next_seq_id = 0
        self._in_admission = 0  # submitted, not yet handed to the scheduler
        self._next_iteration = 1
        self._last_step_ms: float | None = None
        self._last_step_tokens = 0

    # ---- public API -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def scheduler(self) -> Scheduler | None:
        return self._scheduler

    def add_observer(self, observer: Observer) -> None:
        self._observers.append(observer)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._start_worker()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._admission_task)
                nursery.start_soon(self._scheduler_loop)
                task_status.started()
        finally:
            self._ready = False
            self._accepting = False
            self._finish_all("abort", "shutdown")
            with trio.CancelScope(shield=True), trio.move_on_after(_WORKER_STOP_TIMEOUT_S):
                await self._worker.stop()

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        tenant: str = "default",
        priority: int = 0,
    ) -> trio.MemoryReceiveChannel:
        """Queue a request; its channel yields TokenEvent* then one FinishEvent, then closes."""
        if not self._accepting or not self._ready or self._scheduler is None:
            raise EngineUnavailable("the engine is not ready (starting, restarting or stopping)")
        self._validate(prompt_token_ids, params, request_id)
        waiting = len(self._scheduler.waiting) + self._in_admission
        if waiting >= self.config.max_queue:
            raise Overloaded(f"{waiting} requests are waiting; try again later")
        send, receive = trio.open_memory_channel(params.max_tokens + 2)
        ids = list(prompt_token_ids)
        request = Request(
            request_id=request_id,
            seq_id=self._next_seq_id,
            prompt_len=len(ids),
            token_ids=ids,
            params=params,
            tenant=tenant,
            priority=priority,
            received=trio.current_time(),
            stream=send,
            detokenizer=Detokenizer(self._tokenizer, ids, params.stop),
            spec=sampling_spec(params),
        )
        try:
            self._admit_send.send_nowait(request)
        except trio.WouldBlock:
            raise Overloaded("the admission queue is full; try again later") from None
        self._next_seq_id += 1
        self._in_admission += 1
        self._requests[request_id] = request
        self._all_done = trio.Event()
        log.info(
            "request.received",
            request_id=request_id,
            tenant=tenant,
            priority=priority,
            prompt_tokens=len(ids),
            max_tokens=params.max_tokens,
        )
        for observer in self._observers:
            observer.on_request_received(request_id, tenant, len(ids))
        return receive

    def abort(self, request_id: str) -> None:
        """End a request now (synchronous, idempotent); its blocks are free at once."""
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, "abort", "aborted")
            self._wakeup.set()  # freed blocks may let a stuck admission through

    def set_policy(self, name: str, params: dict | None, *, by: str = "api") -> PolicySwap:
        """Swap the policy at the next iteration boundary; PolicyError changes nothing."""
        new = make_policy(name, params)
        old = self.policy_info()
        self._pending_policy = new
        swap = PolicySwap(old=old, new=new.describe(), iteration=self._next_iteration)
        log.info(
            "policy.swap",
            old=old["name"],
            new=new.name,
            params=swap.new["params"],
            iteration=swap.iteration,
            by=by,
        )
        for observer in self._observers:
            observer.on_policy_swap(old["name"], new.name, swap.iteration)
        return swap

    def policy_info(self) -> dict:
        """The policy that decides the next iteration: {"name", "params"}."""
        return (self._pending_policy or self._policy).describe()

    def state(self) -> dict:
        sched = self._scheduler
        return {
            "waiting": len(sched.waiting) if sched else 0,
            "running": len(sched.running) if sched else 0,
            "kv_blocks_used": sched.blocks.num_used if sched else 0,
            "kv_blocks_total": sched.blocks.num_blocks if sched else 0,
            "policy": self.policy_info(),
            "iteration": self._next_iteration - 1,
            "worker_ready": self._ready,
            "max_model_len": self.handshake.max_model_len if self.handshake else None,
        }

    def begin_shutdown(self) -> None:
        self._accepting = False

    async def drain(self, timeout: float) -> None:
        """Let in-flight requests finish for up to `timeout` s, then abort the rest."""
        with trio.move_on_after(timeout):
            while self._requests:
                await self._all_done.wait()
        self._finish_all("abort", "shutdown")

    # ---- validation -------------------------------------------------------------------

    def _validate(self, ids: list[int], params: SamplingParams, request_id: str) -> None:
        handshake = self.handshake
        assert handshake is not None and self._scheduler is not None
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = handshake.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        if isinstance(params.max_tokens, bool) or not isinstance(params.max_tokens, int):
            raise InvalidRequest("max_tokens must be an integer")
        if params.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if not params.temperature >= 0:
            raise InvalidRequest("temperature must be >= 0")
        if not 0 < params.top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1]")
        if params.top_k < 0:
            raise InvalidRequest("top_k must be >= 0")
        if not isinstance(params.stop, list) or not all(isinstance(s, str) for s in params.stop):
            raise InvalidRequest("stop must be a list of strings")
        total = len(ids) + params.max_tokens
        if total > handshake.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the context window of {handshake.max_model_len} tokens"
            )
        blocks = self._scheduler.blocks
        capacity = (blocks.num_blocks - blocks.watermark_blocks) * blocks.block_size
        if total > capacity:
            raise InvalidRequest(
                f"prompt + max_tokens = {total} tokens exceeds the KV cache capacity "
                f"of {capacity} tokens for one request"
            )

    # ---- tasks ------------------------------------------------------------------------

    async def _admission_task(self) -> None:
        async for request in self._admit_recv:
            self._in_admission -= 1
            if request.is_finished or self._scheduler is None:
                continue  # aborted while queued
            self._scheduler.add(request)
            self._wakeup.set()

    async def _scheduler_loop(self) -> None:
        sched = self._scheduler
        assert sched is not None
        while True:
            if not sched.has_work():
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            if not await self._iterate(sched):
                # nothing could be scheduled; only a new request or an abort changes that
                self._wakeup = trio.Event()
                await self._wakeup.wait()

    async def _iterate(self, sched: Scheduler) -> bool:
        started = time.perf_counter()
        if self._pending_policy is not None:
            self._policy = sched.policy = self._pending_policy
            self._pending_policy = None
        iteration = self._next_iteration
        self._next_iteration += 1
        view = sched.build_view(
            iteration, trio.current_time(), self._last_step_ms, self._last_step_tokens
        )
        out = sched.schedule(view, step_id=iteration)
        self._note_preemptions(out)
        if out.plan is None:
            return False
        now = trio.current_time()
        for item in out.scheduled:
            if item.request.first_scheduled is None:
                item.request.first_scheduled = now
                log.info(
                    "request.admitted",
                    request_id=item.request.request_id,
                    queue_ms=(now - item.request.received) * 1000,
                )
        planned = time.perf_counter()
        try:
            result = await self._worker.step(out.plan)
        except WorkerDied as exc:
            await self._recover(exc)
            return True
        stepped = time.perf_counter()
        sched.commit(out)
        self._apply_result(out, result)
        if self.config.debug_invariants:
            sched.blocks.check_invariants()
        self._last_step_ms = result.step_ms
        self._last_step_tokens = out.plan.total_tokens
        schedule_ms = (planned - started + time.perf_counter() - stepped) * 1000
        self._report_iteration(sched, out, out.plan, result, schedule_ms)
        return True

    # ---- results ----------------------------------------------------------------------

    def _apply_result(self, out: ScheduleOutput, result: StepResult) -> None:
        plan = out.plan
        assert plan is not None
        sampled = [s.request for s in out.scheduled if s.samples]
        if result.error is None and result.seq_ids != [r.seq_id for r in sampled]:
            result.error = f"step {plan.step_id}: the worker returned tokens for other sequences"
        if result.error is not None:
            log.info("worker.step_error", step_id=plan.step_id, error=result.error)
            for item in out.scheduled:
                self._finish(item.request, "error", "worker_error", error=result.error)
            return
        now = trio.current_time()
        logprobs = result.logprobs
        for i, request in enumerate(sampled):
            if request.is_finished:
                continue  # aborted while the step ran
            lp = logprobs[i] if logprobs is not None and request.params.logprobs else None
            self._append_token(request, result.tokens[i], lp, now)

    def _append_token(
        self, request: Request, token: int, logprob: float | None, now: float
    ) -> None:
        request.token_ids.append(token)
        request.token_times.append(now)
        if request.first_token is None:
            request.first_token = now
            log.info(
                "request.first_token",
                request_id=request.request_id,
                ttft_ms=(now - request.received) * 1000,
            )
        delta = request.detokenizer.add_token(token)
        finish = None
        if delta.stopped:
            finish = ("stop", "stop_string")
        elif token in self._eos and not request.params.ignore_eos:
            finish = ("stop", "eos")
        elif request.num_generated >= request.params.max_tokens:
            finish = ("length", "max_tokens")
        text = delta.text
        if finish is not None and not delta.stopped:
            text += request.detokenizer.flush()
        event = TokenEvent(text, [token], None if logprob is None else [logprob])
        _send(request, event)
        if finish is not None:
            self._finish(request, *finish)

    def _finish(self, request: Request, reason: str, detail: str, error: str | None = None) -> None:
        if request.is_finished:
            return
        if self._scheduler is not None:
            self._scheduler.remove(request)
        request.status = Status.FINISHED
        request.finished = trio.current_time()
        request.finish_reason, request.finish_detail = reason, detail
        completion = request.num_generated
        _send(request, FinishEvent(reason, detail, request.prompt_len, completion, error))
        request.stream.close()
        self._requests.pop(request.request_id, None)
        if not self._requests:
            self._all_done.set()
        self._report_finished(request)

    def _finish_all(self, reason: str, detail: str) -> None:
        for request in list(self._requests.values()):
            self._finish(request, reason, detail)

    def _note_preemptions(self, out: ScheduleOutput) -> None:
        for request in out.preempted:
            log.info(
                "request.preempted",
                request_id=request.request_id,
                num_generated=request.num_generated,
            )
            for observer in self._observers:
                observer.on_preemption(request.request_id)

    # ---- worker supervision -----------------------------------------------------------

    async def _start_worker(self) -> None:
        handshake = await self._worker.start()
        self.handshake = handshake
        blocks = BlockManager(handshake.num_blocks, handshake.block_size, self.config.watermark)
        if self._scheduler is None:
            self._scheduler = Scheduler(
                blocks,
                self._policy,
                max_batched_tokens=self.config.max_batched_tokens,
                max_num_seqs=self.config.max_num_seqs,
            )
        else:
            self._scheduler.blocks = blocks  # nothing is running across a restart
        self._eos = frozenset(handshake.eos_token_ids) | frozenset(self._tokenizer.eos_token_ids)
        self._ready = True
        log.info(
            "worker.started",
            pid=handshake.pid,
            num_blocks=handshake.num_blocks,
            load_seconds=handshake.load_seconds,
        )

    async def _recover(self, exc: WorkerDied) -> None:
        """Fail what was running, keep what was waiting, restart the worker."""
        self._ready = False
        sched = self._scheduler
        assert sched is not None
        log.info("worker.died", error=str(exc), running=len(sched.running))
        for request in list(sched.running):
            self._finish(request, "error", "worker_died", error="the worker process died")
        self._last_step_ms = None
        attempt = 0
        while True:
            try:
                await self._start_worker()
                return
            except Exception as start_error:  # keep trying; waiting requests stay queued
                delay = _RESTART_BACKOFF_S[min(attempt, len(_RESTART_BACKOFF_S) - 1)]
                log.info("worker.restart_failed", error=str(start_error), retry_in_s=delay)
                attempt += 1
                await trio.sleep(delay)

    # ---- reporting --------------------------------------------------------------------

    def _report_iteration(
        self,
        sched: Scheduler,
        out: ScheduleOutput,
        plan: BatchPlan,
        result: StepResult,
        schedule_ms: float,
    ) -> None:
        stats = IterationStats(
            iteration=out.iteration,
            policy=self._policy.name,
            prefill_tokens=out.prefill_tokens,
            decode_seqs=out.decode_seqs,
            batch_tokens=plan.total_tokens,
            num_seqs=len(plan.seq_ids),
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_blocks_used=sched.blocks.num_used,
            kv_blocks_total=sched.blocks.num_blocks,
            step_ms=result.step_ms,
            schedule_ms=schedule_ms,
            preempted=len(out.preempted),
        )
        log.info("iteration", **dataclasses.asdict(stats))
        for observer in self._observers:
            observer.on_iteration(stats)

    def _report_finished(self, request: Request) -> None:
        assert request.finished is not None
        stats = RequestStats(
            request_id=request.request_id,
            tenant=request.tenant,
            policy=self._policy.name,
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
        )
        itls = sorted(stats.itls)
        log.info(
            "request.finished",
            request_id=stats.request_id,
            tenant=stats.tenant,
            policy=stats.policy,
            finish_reason=stats.finish_reason,
            finish_detail=stats.finish_detail,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            ttft_ms=_ms(stats.ttft),
            itl_p50_ms=_ms(_percentile(itls, 0.50)),
            itl_p99_ms=_ms(_percentile(itls, 0.99)),
            itl_max_ms=_ms(itls[-1] if itls else None),
            queue_ms=_ms(stats.queue_time),
            e2e_ms=_ms(stats.e2e),
            preemptions=stats.preemptions,
            # the last iteration begun: an abort's delay is measurable in iterations
            iteration=self._next_iteration - 1,
        )
        for observer in self._observers:
            observer.on_request_finished(stats)


def _send(request: Request, event: TokenEvent | FinishEvent) -> None:
    """Never blocks: the channel holds max_tokens + 2 events; a gone reader is ignored."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        request.stream.send_nowait(event)


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))
    return sorted_values[index]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
