"""The one place that starts the worker process and talks to it.

The worker runs as `python -m gpu_worker --fd N`, N being its end of a socketpair; the
service keeps the other end as a trio SocketStream and exchanges length-prefixed frames
(gpu_worker.protocol). The process is a trio.Process, reaped by `stop()` (or when a dead
one is replaced), so no zombie and no helper thread is left behind. A step is two calls,
`send_step` and `receive_result`, so that the engine can do other work while the worker
computes; at most one step is out at a time.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import trio

from gpu_worker.protocol import (
    DEVICE_ERROR,
    RANK_HUNG,
    FrameDecoder,
    Handshake,
    NewSeq,
    Row,
    SamplingSpec,
    StepPlan,
    StepResult,
    WorkerConfig,
    encode_frame,
    record_from_message,
    step_result_from_message,
    to_message,
)
from service.config import Config
from service.engine.kv_transfer import ROLE_BOTH, ROLE_PRODUCER
from service.engine.speculation import DRAFT_MODEL
from service.model_files.resolve import resolve_model

_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
_RECEIVE_BYTES = 1 << 16
ADMIN_TOKEN_VARIABLE = "CADENCE_ADMIN_TOKEN"
# glibc's malloc then asks the kernel for 2 MiB pages for its large blocks (the weights,
# the KV cache) where transparent huge pages are on "madvise", the common default: a decode
# step streams some 200 MB of weights and its KV cache, and with 4 KiB pages it misses the
# TLB all along (engine W1 about 3 % faster on a Zen 4, BENCHMARKS.md section 9).
# Other C libraries ignore the variable.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"


class WorkerDied(Exception):
    """The worker process ended (or its channel closed) while the service needed it."""


class WorkerHung(WorkerDied):
    """The worker did not answer a step or a ping in time; it is killed and replaced."""


class WorkerDeviceFault(WorkerDied):
    """A step left the worker's device unusable (a sticky CUDA error): the worker said so
    and exits; it is replaced."""


class WorkerStartError(RuntimeError):
    """The worker could not start: it reported "fatal" or exited during start-up."""


def worker_config_for(config: Config, model_dir: Path | str) -> WorkerConfig:
    """The worker's knobs are Config's fields of the same name (one default for both); a
    draft model (--speculative-config) is resolved as --model is."""
    named = {f.name for f in fields(Config)}
    shared = {f.name: getattr(config, f.name) for f in fields(WorkerConfig) if f.name in named}
    shared["max_loras"] = config.max_loras if config.enable_lora else 0  # 0: no slots
    if config.kv_transfer_role not in (ROLE_PRODUCER, ROLE_BOTH):  # only a producer stages
        shared["kv_staging_tokens"] = 0
    spec = config.speculative_config
    draft_dir = None
    if spec is not None and spec.method == DRAFT_MODEL:
        draft_dir = str(resolve_model(spec.model, config.cache_dir))
    return WorkerConfig(
        model_dir=str(model_dir),
        max_num_batched_tokens=config.max_batched_tokens,
        kernel_cache=str(config.cache_dir / "kernels.json"),
        draft_model_dir=draft_dir,
        draft_quantization="none" if spec is None else spec.quantization,
        # a rank lost mid-step is reported by rank 0 before the step's watchdog fires
        collective_timeout=config.step_timeout / 2,
        kv_transfer_engine=config.kv_engine if config.kv_transfer_role else None,
        **shared,
    )


class WorkerLink:
    def __init__(
        self,
        worker_config: WorkerConfig,
        *,
        command: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        stop_timeout: float = 10.0,
    ) -> None:
        """`command` replaces `python -m gpu_worker` (tests run a fake child with it)."""
        self.worker_config = worker_config
        self._command = list(command or [sys.executable, "-m", "gpu_worker"])
        self._env = env
        self._stop_timeout = stop_timeout
        self._process: trio.Process | None = None
        self._stream: trio.SocketStream | None = None
        self._decoder = FrameDecoder()
        self._inbox: deque[dict[str, Any]] = deque()
        self._pongs_owed = 0  # pings whose answer has not arrived (a ping may be cancelled)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    async def start(self) -> Handshake:
        """Spawn the worker, send init, wait for "ready". Replaces a previous process."""
        await self._discard_process()
        parent, child = socket.socketpair()
        try:
            self._process = await trio.lowlevel.open_process(
                [*self._command, "--fd", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=self._child_env(),
            )
        except OSError as exc:
            parent.close()
            raise WorkerStartError(f"could not start the worker: {exc}") from exc
        finally:
            child.close()
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(parent))
        self._decoder = FrameDecoder()
        self._inbox.clear()
        self._pongs_owed = 0
        try:
            await self._send(to_message("init", self.worker_config))
            reply = await self._receive()
        except WorkerDied as exc:
            await self._discard_process()
            code = self.returncode
            raise WorkerStartError(f"the worker exited during start-up (code {code})") from exc
        if reply.get("type") == "fatal":
            await self._discard_process()
            raise WorkerStartError(f"the worker failed to start: {reply.get('message')}")
        if reply.get("type") != "ready":
            await self._discard_process()
            raise WorkerStartError(f"unexpected first message from the worker: {reply!r:.200}")
        handshake = record_from_message(Handshake, reply)
        await self._warm_up(handshake)
        return handshake

    async def _warm_up(self, handshake: Handshake) -> None:
        """A prefill and a decode step through a scratch block before anyone waits on the
        worker: first calls pay one-off costs (kernel loading, allocator growth) that would
        otherwise land on the first request's TTFT, and could trip the step watchdog."""
        length = max(1, min(8, handshake.block_size - 1, handshake.max_model_len - 1))
        token = min(1, handshake.vocab_size - 1)
        groups = len(handshake.kv_group_windows)
        # one sequence: its prompt, then (where a block has room) its first decode row, which
        # continues it as any decode row does (a recurrent state's model needs that)
        plans = [
            StepPlan(
                -1,
                # nothing owns a block yet (the engine allocates later): block 0 serves
                [Row(0, length, 0, blocks=[[0]] * groups, blocks_at=0)],
                [token] * length,
                new=[NewSeq(0, SamplingSpec(), prompt_len=length)],
            )
        ]
        if length < handshake.block_size:
            decode = Row(0, 1, length, blocks=[[]] * groups, blocks_at=1)
            plans.append(StepPlan(-2, [decode], [token]))
        plans.append(StepPlan(-len(plans) - 1, [], [], finished=[0]))  # the worker forgets it
        for plan in plans:
            try:
                result = await self.step(plan)
            except WorkerDied as exc:
                await self._discard_process()
                raise WorkerStartError(f"the worker failed its warm-up step: {exc}") from exc
            if result.error is not None:
                await self._discard_process()
                raise WorkerStartError(f"the worker failed its warm-up step: {result.error}")

    async def step(self, plan: StepPlan) -> StepResult:
        """One plan and its result, when there is nothing to do meanwhile (the warm-up)."""
        await self.send_step(plan)
        return await self.receive_result(plan.step_id)

    async def send_step(self, plan: StepPlan) -> None:
        """Hand the worker its next plan; send one only after the previous one's result."""
        await self._send(to_message("step", plan))

    async def receive_result(self, step_id: int) -> StepResult:
        """The result of the plan sent last; WorkerDied if the worker fails it."""
        reply = await self._receive_answer()
        kind = reply.get("type")
        if kind == "fatal":
            raise _fatal(reply)
        if kind != "result":
            raise WorkerDied(f"unexpected message from the worker: {kind!r:.200}")
        result = _result_of(reply)
        if result.step_id != step_id:
            raise WorkerDied(f"result for step {result.step_id}, expected {step_id}")
        return result

    async def ping(self) -> None:
        """One round trip; proves the worker still answers between steps (none is out)."""
        await self._send({"type": "ping"})
        self._pongs_owed += 1  # after the send: a send cancelled at its start sent nothing
        while self._pongs_owed:
            reply = await self._receive()
            if reply.get("type") == "fatal":  # a rank of its group lost (gpu_worker.faults)
                raise _fatal(reply)
            if reply.get("type") != "pong":
                raise WorkerDied(f"unexpected message from the idle worker: {reply!r:.200}")
            self._pongs_owed -= 1

    async def wait_closed(self) -> None:
        """Return as soon as the worker closes its channel (it exited); only call it between
        steps. Cancelling it loses nothing: trio's receive_some is cancel-safe."""
        stream = self._stream
        if stream is None:
            return
        while True:
            try:
                data = await stream.receive_some(_RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            with contextlib.suppress(ValueError):  # a garbled frame shows at the next step
                self._inbox.extend(self._decoder.feed(data))

    async def stop(self) -> None:
        """Ask the worker to exit; kill it if it has not after the timeout; reap it."""
        if self._process is None:
            return
        with contextlib.suppress(WorkerDied):
            await self._send({"type": "shutdown"})
        await self._discard_process()

    async def kill(self) -> None:
        """End a hung or broken worker at once (SIGKILL) and reap it."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
        await self._discard_process()

    # ---- internals --------------------------------------------------------------------

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ if self._env is None else self._env)
        env.pop(ADMIN_TOKEN_VARIABLE, None)  # the worker has no use for the admin secret
        # the worker imports gpu_worker from this checkout even when it is not installed
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = _PROJECT_ROOT + (os.pathsep + path if path else "")
        env["GLIBC_TUNABLES"] = _with_huge_pages(env.get("GLIBC_TUNABLES", ""))
        return env

    async def _send(self, msg: dict[str, Any]) -> None:
        if self._stream is None:
            raise WorkerDied("the worker is not running")
        try:
            await self._stream.send_all(encode_frame(msg))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise WorkerDied(f"the worker channel is closed: {exc}") from exc

    async def _receive_answer(self) -> dict[str, Any]:
        """The next message that is not the late answer of a cancelled ping."""
        while True:
            reply = await self._receive()
            if reply.get("type") == "pong" and self._pongs_owed:
                self._pongs_owed -= 1
                continue
            return reply

    async def _receive(self) -> dict[str, Any]:
        stream = self._stream
        while not self._inbox:
            if stream is None:
                raise WorkerDied("the worker is not running")
            try:
                data = await stream.receive_some(_RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise WorkerDied(f"the worker channel broke: {exc}") from exc
            if not data:
                raise WorkerDied("the worker process closed its channel (exited?)")
            try:
                self._inbox.extend(self._decoder.feed(data))
            except ValueError as exc:
                raise WorkerDied(f"garbled frame from the worker: {exc}") from exc
        message = self._inbox.popleft()
        if not isinstance(message, dict):
            raise WorkerDied(f"garbled message from the worker: {message!r:.200}")
        return message

    async def _discard_process(self) -> None:
        """Close the channel and make sure the process is gone and reaped."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()
        if self._process is not None:
            await self._reap()

    async def _reap(self) -> int | None:
        process = self._process
        if process is None:
            return None
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self._stop_timeout):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
        return process.returncode


def _with_huge_pages(tunables: str) -> str:
    """GLIBC_TUNABLES with huge pages for malloc, unless the operator set that one."""
    if HUGE_PAGES_TUNABLE + "=" in tunables:
        return tunables
    return ":".join(filter(None, (tunables, HUGE_PAGES_TUNABLE + "=1")))


def _fatal(reply: dict[str, Any]) -> WorkerDied:
    """What a "fatal" message says of the worker: its device unusable, a rank of its group
    stopped answering (hung), or any other end (died)."""
    kinds = {DEVICE_ERROR: WorkerDeviceFault, RANK_HUNG: WorkerHung}
    fault = kinds.get(str(reply.get("reason")), WorkerDied)
    return fault(f"the worker reported a fatal error: {reply.get('message')}")


def _result_of(reply: dict[str, Any]) -> StepResult:
    """A result message as a StepResult; one that does not fit the contract means a worker
    gone wrong, to be restarted (WorkerDied), never an error that ends the server."""
    try:
        result = step_result_from_message(reply)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise WorkerDied(f"garbled result from the worker: {exc!r:.200}") from exc
    tokens, seq_ids = result.tokens, result.seq_ids
    if not isinstance(tokens, list) or not isinstance(seq_ids, list) or len(tokens) != len(seq_ids):
        raise WorkerDied("garbled result from the worker: tokens and seq_ids do not pair up")
    if not all(isinstance(row, list) and row for row in tokens):
        raise WorkerDied("garbled result from the worker: a sequence without a token list")
    if not all(isinstance(t, int) and not isinstance(t, bool) for row in tokens for t in row):
        raise WorkerDied("garbled result from the worker: a token that is not an integer")
    return result
