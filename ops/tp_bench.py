"""The decode step at each tensor-parallel size, and the collectives' share of it:

    cadence bench tensor-parallel --sizes 1 3 --batches 1 16 64 --context 256

For each size it starts the worker as the server does (at N > 1 rank 0 here, its followers
spawned by gpu_worker.worker_group, each plan handed to them as the worker hands it) and
times decode steps of each batch at `--context` tokens (median of `--steps`, after a
warm-up). On rank 0 it also times every torch.distributed call the step makes: their sum
is the collectives' share, waiting for the slowest rank included. The last column times
the collectives alone, in N fresh processes over gloo: 2L + 1 all-reduces of the step's
[batch, hidden] and the logits' gather, no compute between them (the transport's floor).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_worker import runtime
from gpu_worker.protocol import StepPlan, WorkerConfig, to_message
from gpu_worker.runner import ModelRunner
from gpu_worker.tensor_parallel import Shard
from gpu_worker.worker_group import Group, GroupSpec, data_backend
from ops.summary import format_table
from ops.worker_steps import Seq, plan_of
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model

TIMED = ("all_gather_single", "all_gather_into_tensor", "gather", "broadcast", "all_reduce")


class CollectiveClock:
    """Seconds spent inside torch.distributed's collectives since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in TIMED:
            if hasattr(dist, name):
                setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return collective(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        return timed


def decode_plan(runner: ModelRunner, batch: int, context: int, step_id: int) -> StepPlan:
    """`batch` sequences each adding one token at position `context`, own blocks each."""
    block_size = runner.cache.block_size
    width = context // block_size + 1
    seqs = [
        Seq(i, [100 + i], context, list(range(i * width, (i + 1) * width))) for i in range(batch)
    ]
    return plan_of(seqs, step_id, runner.limits.num_groups)


def timed_steps(
    runner: ModelRunner, group: Group | None, plan: StepPlan, steps: int, clock: CollectiveClock
) -> tuple[float, float]:
    """Median step ms and median collectives ms over `steps` steps (after two warm-ups)."""
    step_ms, collective_ms = [], []
    for i in range(steps + 2):
        clock.seconds = 0.0
        began = time.perf_counter()
        if group is not None:
            group.send(to_message("step", plan))
        result = runner.execute(plan)
        elapsed = time.perf_counter() - began
        assert result.error is None, result.error
        if i >= 2:
            step_ms.append(elapsed * 1000)
            collective_ms.append(clock.seconds * 1000)
    return statistics.median(step_ms), statistics.median(collective_ms)


def collectives_alone(
    size: int, layers: int, hidden: int, vocab: int, batch: int, steps: int
) -> float:
    """Median ms of one step's collectives with no compute, over `size` spawned ranks:
    2L + 1 all-reduces of bfloat16 [batch, hidden] and the gather of [batch, vocab / size]
    float32 logits."""
    with tempfile.TemporaryDirectory() as workdir:
        out = f"{workdir}/rank0.pt"
        shape = (layers, hidden, vocab, batch, steps, f"{workdir}/rendezvous", out)
        mp.start_processes(
            _collectives_rank, args=(size, *shape), nprocs=size, start_method="spawn"
        )
        return float(torch.load(out))


def _collectives_rank(
    rank: int, size: int, layers: int, hidden: int, vocab: int, batch: int, steps: int,
    rendezvous: str, out: str,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    shard = Shard.of()
    rows = torch.zeros(batch, hidden, dtype=torch.bfloat16)
    logits = torch.zeros(batch, -(-vocab // size))
    times = []
    for _ in range(steps + 2):
        began = time.perf_counter()
        for _ in range(2 * layers + 1):
            shard.all_reduce(rows)
        shard.gather(logits)
        times.append((time.perf_counter() - began) * 1000)
    dist.destroy_process_group()
    if rank == 0:
        torch.save(torch.tensor(statistics.median(times[2:])), out)


def bench_size(args: argparse.Namespace, size: int, clock: CollectiveClock) -> list[list[str]]:
    config = WorkerConfig(
        model_dir=str(resolve_model(args.model, default_cache_dir())),
        dtype=args.dtype,
        device="cpu",
        kv_memory=args.kv_memory,
        max_num_seqs=max(args.batches),
        use_cuda_graphs=False,
        kernels=args.kernels,
        kernel_cache=str(default_cache_dir() / "kernels.json"),
        tensor_parallel_size=size,
        collective_timeout=120.0,
    )
    group = None
    if size > 1:
        spec = GroupSpec(size, data_backend(torch.device("cpu")), config.collective_timeout)
        group = Group.lead(spec)
        group.send(to_message("init", config))
    try:
        runner = runtime.start(config, group)
        measured = []
        for batch in args.batches:
            plan = decode_plan(runner, batch, args.context, step_id=batch)
            measured.append((batch, *timed_steps(runner, group, plan, args.steps, clock)))
        model_config = runner.model.config
    finally:
        if group is not None:
            group.close()
    rows = []
    for batch, step, collectives in measured:
        row = [str(size), str(batch), f"{step:.2f}", "-", "-", "-"]
        if size > 1:
            floor = collectives_alone(
                size,
                model_config.num_hidden_layers,
                model_config.hidden_size,
                model_config.vocab_size,
                batch,
                args.steps,
            )
            row[3:] = [f"{collectives:.2f}", f"{100 * collectives / step:.0f} %", f"{floor:.2f}"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence bench tensor-parallel", description=__doc__)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--kv-memory", type=float, default=1e9)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    clock = CollectiveClock()
    rows = [row for size in args.sizes for row in bench_size(args, size, clock)]
    header = ["TP", "batch", "step ms", "collectives ms", "share", "collectives alone ms"]
    print(format_table(header, rows))
    return 0
