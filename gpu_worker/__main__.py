"""The worker process: `python -m gpu_worker --fd N`.

N is an inherited, connected stream socket. The loop is plain blocking I/O: the process
does one thing at a time (receive a step, compute it, answer), so nothing is gained from
an event loop. Each result says how long the worker waited for its plan (`idle_ms`): the
time the device sat idle while the service prepared the step. It exits 0 on "shutdown" or
when the socket closes, 1 when init fails, 3 after a step left the device unusable
(gpu_worker.faults): it reports "fatal" first, and the service starts a fresh process.

With tensor_parallel_size N > 1 in its init this process is rank 0 of a group
(gpu_worker.worker_group): it starts the N - 1 followers, hands each message it receives
to them before it handles it, and alone samples and answers. A rank lost is "fatal" too.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from gpu_worker.faults import DeviceFault, GroupFault
from gpu_worker.process import EXIT_DEVICE_FAULT, keep_freed_memory, log
from gpu_worker.protocol import (
    MAX_IDLE_GAP_S,
    FrameDecoder,
    StepResult,
    WorkerConfig,
    encode_frame,
    record_from_message,
    step_plan_from_message,
    to_message,
)

if TYPE_CHECKING:
    from gpu_worker.runner import ModelRunner
    from gpu_worker.worker_group import Group

RECEIVE_BYTES = 1 << 20


class WorkerLoop:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.runner: ModelRunner | None = None  # once "init" succeeded
        self.group: Group | None = None  # the tensor-parallel group this process leads
        self.answered_at: float | None = None  # when the last step's result went out
        self.received_at = 0.0  # when the bytes of the messages being handled arrived

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(msg))

    def serve(self) -> int:
        """Answers messages until shutdown or end of stream; returns the exit status."""
        try:
            return self._serve()
        finally:
            if self.runner is not None and self.runner.kv is not None:
                self.runner.kv.close()  # its pulls' thread ends before the process
            if self.group is not None:
                self.group.close()

    def _serve(self) -> int:
        decoder = FrameDecoder()
        while True:
            data = self.sock.recv(RECEIVE_BYTES)
            self.received_at = time.perf_counter()
            if not data:
                log("service closed the channel; exiting")
                return 0
            for msg in decoder.feed(data):
                status = self.handle(msg)
                if status is not None:
                    return status

    def handle(self, msg: dict[str, Any]) -> int | None:
        kind = msg.get("type")
        if kind == "step":
            try:
                self.hand_on(msg)
                result = self.step(msg)
            except DeviceFault as fault:
                return self.give_up(f"step {msg.get('step_id', -1)}", fault)
            result.idle_ms = self.idle_ms()
            # Stamped before the send: waking the service may preempt this process inside
            # sendall, and the wait for the next plan starts when the result is ready.
            self.answered_at = time.perf_counter()
            self.send(to_message("result", result))
        elif kind == "ping":
            self.answered_at = None  # the service pings only when it has nothing to run
            try:
                self.hand_on(msg)
                if self.group is not None:
                    self.group.heartbeat()
            except DeviceFault as fault:
                return self.give_up("a heartbeat", fault)
            self.send({"type": "pong"})
        elif kind == "init":
            return self.init(msg)
        elif kind == "shutdown":
            log("shutdown requested; exiting")
            return 0  # serve's end tells the followers
        else:
            log(f"ignoring a message of unknown type {kind!r}")
        return None

    def hand_on(self, msg: dict[str, Any]) -> None:
        """The followers get each message rank 0 handles, before it handles it."""
        if self.group is None:
            return
        try:
            self.group.send(msg)
        except RuntimeError as exc:
            raise GroupFault(f"handing a message to the followers failed: {exc}") from exc

    def followers_seen(self) -> str:
        """ " (what went wrong with the followers)", where something shows; the group is
        then marked broken, so that the end of serve does not wait on it."""
        if self.group is None:
            return ""
        self.group.broken = True
        seen = self.group.failures()
        return f" ({seen})" if seen else ""

    def give_up(self, what: str, fault: DeviceFault) -> int:
        """A sticky device error or a lost rank: every later step would fail too, so say
        why and exit."""
        message = f"{what}: {fault}{self.followers_seen()}"
        log(f"the worker is unusable; exiting: {message}")
        traceback.print_exception(fault.__cause__ or fault, file=sys.stderr)
        self.send({"type": "fatal", "reason": fault.reason, "message": message})
        return EXIT_DEVICE_FAULT

    def idle_ms(self) -> float | None:
        """How long this plan kept the worker waiting after its previous result; None when
        the service was idle rather than busy preparing the step."""
        if self.answered_at is None:
            return None
        gap = max(0.0, self.received_at - self.answered_at)
        return gap * 1000 if gap <= MAX_IDLE_GAP_S else None

    def init(self, msg: dict[str, Any]) -> int | None:
        # Imported here so a worker that is only spawned and closed never pays for torch.
        from gpu_worker import runtime
        from gpu_worker.device import unusable_gpu_warning

        config = record_from_message(WorkerConfig, msg)
        device_warning = unusable_gpu_warning(config.device)
        if device_warning is not None:
            log(f"WARNING: {device_warning}")  # before loading, which may take minutes
        try:
            runtime.check(config)  # its refusals before any follower starts
            self.group = _lead_group(config)
            self.hand_on(msg)
            runner = runtime.start(config, self.group)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}{self.followers_seen()}"
            log(f"init failed: {message}")
            self.send({"type": "fatal", "message": message})
            return 1
        self.runner, handshake = runner, runner.handshake
        assert handshake is not None  # runtime.start gives its runner one
        handshake.device_warning = device_warning
        log(
            f"ready: {handshake.model_name} on {handshake.device} ({handshake.dtype}), "
            f"{handshake.num_blocks} KV blocks, loaded in {handshake.load_seconds:.1f}s "
            f"({_steps(handshake.startup)}); "
            f"kernels {_chosen(handshake.kernels)}"
        )
        self.send(to_message("ready", handshake))
        return None

    def step(self, msg: dict[str, Any]) -> StepResult:
        step_id = msg.get("step_id", -1)
        if self.runner is None:
            return StepResult(step_id=step_id, error="step received before a successful init")
        try:
            plan = step_plan_from_message(msg)
        except Exception as exc:  # any malformed message is the sender's error, not fatal
            return StepResult(step_id=step_id, error=f"malformed step message: {exc!r}")
        result = self.runner.execute(plan)
        if result.error is not None:
            log(f"step {step_id} failed: {result.error}")
        return result


def _lead_group(config: WorkerConfig) -> Group | None:
    """The group this worker leads at tensor_parallel_size > 1 (its followers started and
    joined); None for a worker of its own."""
    if config.tensor_parallel_size <= 1:
        return None
    from gpu_worker.device import resolve_device
    from gpu_worker.worker_group import Group, GroupSpec, data_backend

    backend = data_backend(resolve_device(config.device))
    spec = GroupSpec(config.tensor_parallel_size, backend, config.collective_timeout)
    return Group.lead(spec, config.tensor_parallel_address, config.tensor_parallel_size_local)


def _steps(startup: dict[str, float]) -> str:
    """ "config 0.1s, kernels 0.0s, weights 1.2s, cache 0.4s, graphs 0.0s" """
    return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in startup.items())


def _chosen(report: dict) -> str:
    """ "attention=native layer_ops=native matmul=onednn (measured)" """
    names = " ".join(f"{seam}={report[seam]}" for seam in ("attention", "layer_ops", "matmul"))
    return f"{names} ({'cached' if report['cached'] else 'measured'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker", description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="inherited connected socket")
    args = parser.parse_args(argv)
    keep_freed_memory()
    sock = socket.socket(fileno=args.fd)
    try:
        return WorkerLoop(sock).serve()
    except (BrokenPipeError, ConnectionResetError):
        log("service went away; exiting")
        return 0
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
