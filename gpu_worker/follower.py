"""A follower rank of a tensor-parallel worker group (gpu_worker.worker_group):

    python -m gpu_worker.follower --store HOST:PORT --rank R [--local-rank L --local-size K]

Rank 0 starts those on its own host, with `--parent` (its pid): they die with it. Ranks on
another host (vLLM's headless mode, rank 0 started with --tensor-parallel-size-local) are
started by hand or by a supervisor there, against the address rank 0's store listens on
(--tensor-parallel-address); the group's size, backend and collective timeout come from
the store. `--local-rank` (default: the rank) picks the GPU on that host and `--local-size`
(default: the group's size) the share of its cores. Such a follower exits when rank 0's
group goes away. It receives every message rank 0
receives, in order: the init, from which it builds its shard of the model as rank 0 does
(gpu_worker.runtime), then each plan, whose step it runs as far as the collectives reach
(ModelRunner.follow: the forward and the logits, nothing sampled); each ping becomes a
heartbeat. With a KV transfer engine it pulls its shard of each plan's pulls and
serves its shard to consumers (gpu_worker.kv_ranks). It answers nobody: rank 0 alone
samples and speaks to the service. A step
error here is rank 0's error too (the same plan fails the same way before any
collective), so it is only logged. When a collective fails here (another rank lost) it
waits for rank 0's end, which ends it: exiting would show rank 0 a rank lost where a rank
had stopped, and rank 0 alone tells the service which.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING, NoReturn

from gpu_worker.faults import DeviceFault, GroupFault
from gpu_worker.process import EXIT_DEVICE_FAULT, die_with_parent, keep_freed_memory, log
from gpu_worker.protocol import WorkerConfig, record_from_message, step_plan_from_message

if TYPE_CHECKING:
    from gpu_worker.runner import ModelRunner
    from gpu_worker.worker_group import Group


def follow(group: Group, runner: ModelRunner) -> int:
    """Runs rank 0's messages until its shutdown; returns the exit status."""
    while True:
        try:
            msg = group.receive()
        except RuntimeError as exc:  # rank 0 went away; its death signal may be on its way
            log(f"rank 0 is gone; exiting: {exc}", group.rank)
            return 0
        kind = msg.get("type")
        if kind == "step":
            status = follow_step(group, runner, msg)
            if status is not None:
                return status
        elif kind == "ping":
            try:
                group.heartbeat()
            except GroupFault as fault:
                return await_rank_0(group, f"a heartbeat failed: {fault}")
        elif kind == "shutdown":
            return 0


def follow_step(group: Group, runner: ModelRunner, msg: dict) -> int | None:
    """One plan's step; the exit status where it left this rank unusable."""
    try:
        plan = step_plan_from_message(msg)
    except Exception:
        return None  # rank 0 answers the malformed message; no collective ran
    try:
        error = runner.follow(plan)
    except GroupFault as fault:
        return await_rank_0(group, f"step {plan.step_id} failed: {fault}")
    except DeviceFault as fault:
        log(f"step {plan.step_id} left this rank unusable; exiting: {fault}", group.rank)
        return EXIT_DEVICE_FAULT
    if error is not None:
        log(f"step {plan.step_id} failed: {error}", group.rank)
    return None


def await_rank_0(group: Group, why: str) -> NoReturn:
    """Wait for rank 0, which saw the group fail too, to report it and end: its end ends
    this process (die_with_parent)."""
    log(f"{why}; waiting for rank 0 to end the group", group.rank)
    while True:
        signal.pause()


def start(group: Group) -> ModelRunner | None:
    """This rank's runner, from rank 0's init; None where it cannot serve (rank 0 is
    told why through the store)."""
    from gpu_worker import runtime

    try:
        config = record_from_message(WorkerConfig, group.receive())
        return runtime.start(config, group)
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        log(f"init failed: {message}", group.rank)
        group.report_failure(message)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker.follower", description=__doc__)
    parser.add_argument("--store", required=True, help="rank 0's store, HOST:PORT")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, help="among this host's ranks (its GPU)")
    parser.add_argument("--local-size", type=int, help="ranks on this host (its cores)")
    parser.add_argument("--parent", type=int, help="rank 0's pid, to die with it")
    args = parser.parse_args(argv)
    if args.parent is not None:
        die_with_parent(args.parent)
    keep_freed_memory()
    from gpu_worker.worker_group import Group

    group = Group.join(args.store, args.rank, args.local_rank, args.local_size)
    runner = start(group)
    if runner is None:
        return 1
    try:
        return follow(group, runner)
    finally:
        if runner.kv is not None:
            runner.kv.close()  # its pulls' thread ends before the process, as rank 0's


if __name__ == "__main__":
    sys.exit(main())
