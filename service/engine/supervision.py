"""Supervision of the worker: start it, watch it while idle, put it down and restart it.

The engine decides what becomes of requests when a worker goes (its running ones fail, its
waiting ones wait for the next worker); this file owns the process's life: the start-up
deadline, the idle pings, the failure record the admin API shows, and the restarts with
back-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import trio

from gpu_worker.protocol import Handshake, StepPlan, StepResult
from service.engine.worker_link import (
    WorkerDeviceFault,
    WorkerDied,
    WorkerHung,
    WorkerStartError,
)

log = structlog.get_logger()

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
WORKER_STOP_TIMEOUT_S = 10.0
WORKER_START_TIMEOUT_S = 900.0  # loading, converting, building kernels: slow, not endless
IDLE_PING_S = 1.0  # how often an idle worker must prove it still answers


class Worker(Protocol):
    """What the engine needs of a worker (WorkerLink; tests use a simulated one). One plan
    is in flight at most: the next is sent after the previous one's result is received."""

    async def start(self) -> Handshake: ...
    async def send_step(self, plan: StepPlan) -> None: ...
    async def receive_result(self, step_id: int) -> StepResult: ...
    async def ping(self) -> None: ...  # only while no plan is in flight
    async def wait_closed(self) -> None: ...  # returns when the worker is gone (between steps)
    async def kill(self) -> None: ...
    async def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a worker was put down, and what its running requests are told."""

    reason: str  # the admin API's last_worker_failure.reason
    event: str  # the log line
    detail: str  # the finish detail of its running requests
    error: str  # and their error

    @classmethod
    def of(cls, exc: WorkerDied) -> Failure:
        # A device fault ends the running requests as a death does: the worker exits, and
        # its KV cache with it; clients already know `worker_died`.
        if isinstance(exc, WorkerHung):
            return cls("worker_hung", "worker.hung", "worker_hung", "the worker stopped answering")
        if isinstance(exc, WorkerDeviceFault):
            error = "the worker exited after a device error"
            return cls("device_error", "worker.device_error", "worker_died", error)
        return cls("worker_died", "worker.died", "worker_died", "the worker process died")


class Supervisor:
    """Owns the worker process's life; `on_started` gets every new worker's handshake."""

    def __init__(
        self,
        worker: Worker,
        *,
        step_timeout: float,
        max_restarts: int,
        on_started: Callable[[Handshake], None],
    ) -> None:
        self.worker = worker
        self._step_timeout = step_timeout
        self._max_restarts = max_restarts
        self._on_started = on_started
        self.restarts = 0
        # why the worker was last replaced: {"reason", "error", "at" (Unix seconds)}
        self.last_failure: dict[str, Any] | None = None

    async def start(self) -> None:
        with trio.move_on_after(WORKER_START_TIMEOUT_S) as start:
            handshake = await self.worker.start()
        if start.cancelled_caught:
            await self.worker.kill()
            raise WorkerStartError(f"the worker did not start within {WORKER_START_TIMEOUT_S} s")
        try:
            self._on_started(handshake)
        except WorkerStartError:  # a worker the service cannot use (what it serves refused)
            await self.worker.kill()
            raise

    async def sleep_until(self, woken: trio.Event) -> None:
        """Sleep until `woken` is set, watching the idle worker meanwhile: one that dies or
        hangs while nothing runs raises WorkerDied at once, not at the next request."""
        failure: list[WorkerDied] = []

        async def watch(cancel_scope: trio.CancelScope) -> None:
            try:
                await self._watch_idle()
            except WorkerDied as exc:
                failure.append(exc)
            cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            await woken.wait()
            nursery.cancel_scope.cancel()
        if failure:
            raise failure[0]

    async def _watch_idle(self) -> None:
        while True:
            with trio.move_on_after(IDLE_PING_S):
                await self.worker.wait_closed()
                raise WorkerDied("the worker process exited while idle")
            with trio.move_on_after(self._step_timeout):
                await self.worker.ping()
                continue
            raise WorkerHung(f"the idle worker did not answer a ping in {self._step_timeout} s")

    async def put_down(self, exc: WorkerDied, running: int) -> Failure:
        """Record and log why the worker goes, and kill it (a hung or half-dead process must
        not linger)."""
        failure = Failure.of(exc)
        self.last_failure = {"reason": failure.reason, "error": str(exc), "at": time.time()}
        log.error(failure.event, error=str(exc), running=running)
        with trio.CancelScope(shield=True):
            await self.worker.kill()
        return failure

    async def restart(self) -> bool:
        """Start a new worker, with back-off between failed tries; False after
        `max_restarts` failed starts in a row."""
        for attempt in range(self._max_restarts):
            if attempt:
                await trio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S)) - 1])
            try:
                await self.start()
                self.restarts += 1
                return True
            except Exception as start_error:  # waiting requests stay queued while we retry
                log.error("worker.restart_failed", attempt=attempt + 1, error=str(start_error))
        return False

    async def stop(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(WORKER_STOP_TIMEOUT_S):
            await self.worker.stop()
