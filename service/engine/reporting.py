"""What the engine tells the world: its structured log lines and its observers (metrics).

One Reporter per engine; each event is one call, which writes its log line and hands the
same facts to every observer (service.api.metrics is one), so a log and a metric never
disagree about what happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import structlog

from gpu_worker.protocol import Handshake, StepResult
from service.engine.request import Request
from service.engine.stats import IterationStats, Observer, RequestEvent, RequestStats
from service.engine.step import ScheduleOutput, SchedulerStats

log = structlog.get_logger()


class Reporter:
    def __init__(self, log_iterations: int) -> None:
        self.log_iterations = log_iterations  # every Nth iteration is logged; 0: none
        self.observers: list[Observer] = []
        self._preempted: set[str] = set()  # request ids preempted and not yet resumed

    def worker_started(self, handshake: Handshake, overlap_seqs: int | None) -> None:
        """`overlap_seqs`: the most sequences a step overlaps with (None: any)."""
        log.info(
            "worker.started",
            pid=handshake.pid,
            ranks=handshake.ranks,
            num_blocks=handshake.num_blocks,
            load_seconds=handshake.load_seconds,
            startup=handshake.startup,
            kernels=handshake.kernels,
            graphs=handshake.graphs,
            overlap_seqs=overlap_seqs,
            quantization=handshake.quantization,
            draft_model=handshake.draft_model,
        )
        if handshake.device_warning is not None:
            log.warning("worker.device_warning", warning=handshake.device_warning)

    def received(self, request: Request, n: int) -> None:
        """`n`: the sequences of its client request (it is one of them)."""
        sampling = request.params.sampling
        fields = {
            "n": n,
            "tenant": request.tenant,
            "adapter": request.params.adapter,
            "priority": request.priority,
            "prompt_tokens": request.prompt_len,
            "max_tokens": request.params.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            **(request.trace_headers or {}),  # the caller's trace, so a log line finds it
        }
        self._event(request, "received", request.received, fields)
        for observer in self.observers:
            observer.on_request_received(request.request_id, request.tenant, request.prompt_len)

    def refused(self, request_id: str, reason: str) -> None:
        """Load shed: refused at arrival, or its deadline passed before it started."""
        log.info("request.refused", request_id=request_id, reason=reason)
        for observer in self.observers:
            observer.on_request_refused(reason)

    def scheduled(self, out: ScheduleOutput, now: float) -> None:
        """A step's milestones: the requests it starts for the first time, those it takes
        back after a preemption, each prefill chunk, and the requests it preempted."""
        for request in out.started:
            at = request.first_scheduled
            assert at is not None  # what `started` means
            queue_ms = (at - request.received) * 1000  # Phases.queue's
            fields = {"policy": out.policy, "queue_ms": queue_ms, "iteration": out.iteration}
            self._event(request, "admitted", at, fields)
        if self._preempted:  # rarely: only then is every row looked at
            for item in out.scheduled:
                self._resumed(item.request, out, now)
        for item in out.chunks:
            fields = {"tokens": item.num_tokens, "start": item.start, "iteration": out.iteration}
            self._event(item.request, "prefill_chunk", now, fields)
        for request in out.preempted:
            self._preempted.add(request.request_id)
            fields = {"num_generated": request.num_generated, "iteration": out.iteration}
            self._event(request, "preempted", now, fields)
            for observer in self.observers:
                observer.on_preemption(request.request_id)

    def _resumed(self, request: Request, out: ScheduleOutput, now: float) -> None:
        if request.request_id in self._preempted:
            self._preempted.discard(request.request_id)
            fields = {"policy": out.policy, "iteration": out.iteration}
            self._event(request, "resumed", now, fields)

    def first_token(self, request: Request, now: float) -> None:
        ttft_ms = (now - request.received) * 1000
        self._event(request, "first_token", now, {"ttft_ms": ttft_ms})

    def iteration(
        self, out: ScheduleOutput, result: StepResult, stats: SchedulerStats, service_s: float
    ) -> None:
        assert out.plan is not None
        record = IterationStats(
            iteration=out.iteration,
            policy=out.policy,
            prefill_tokens=out.prefill_tokens,
            decode_seqs=out.decode_seqs,
            batch_tokens=out.plan.total_tokens,
            num_seqs=len(out.plan.seq_ids),
            running=stats.running,
            waiting=stats.waiting,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            step_ms=result.step_ms,
            schedule_ms=service_s * 1000,
            preempted=len(out.preempted),
            worker_idle_ms=result.idle_ms,
            drafting_seqs=out.drafting_seqs,
            draft_tokens=out.draft_tokens,
            accepted_tokens=out.accepted_tokens,
            adapters=out.adapters,
            adapter_loads=len(out.plan.adapters),
        )
        every = self.log_iterations
        if every and out.iteration % every == 0:
            # shallow: the record is flat, and asdict's deep copies showed on every step
            log.info("iteration", **{f.name: getattr(record, f.name) for f in _ITERATION_FIELDS})
        for observer in self.observers:
            observer.on_iteration(record)

    def finished(self, request: Request, policy: str, iteration: int) -> None:
        self._preempted.discard(request.request_id)
        stats = RequestStats.of(request, policy, iteration)
        log.info("request.finished", **stats.log_fields())
        for observer in self.observers:
            observer.on_request_finished(stats)

    def _event(self, request: Request, name: str, at: float, fields: Mapping[str, object]) -> None:
        """A milestone of `request`: its log line, and the same record to every observer."""
        log.info(f"request.{name}", request_id=request.request_id, **fields)
        event = RequestEvent(request.request_id, name, at, fields)
        for observer in self.observers:
            observer.on_request_event(event)

    def policy_swap(self, old: dict, new: dict, iteration: int, by: str) -> None:
        log.info(
            "policy.swap",
            old=old["name"],
            new=new["name"],
            params=new["params"],
            iteration=iteration,
            by=by,
        )
        for observer in self.observers:
            observer.on_policy_swap(old["name"], new["name"], iteration)


_ITERATION_FIELDS = dataclasses.fields(IterationStats)
