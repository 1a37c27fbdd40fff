"""The host's work from a decode step's plan to its forward (issue 49):

    cadence bench plan [--batches 1 64 128] [--contexts 1024 8192] [--repeats 200]

For each batch B and context C: a decode step of B sequences at position C - 1 (each one
introduced and its C tokens' blocks sent by an earlier plan, as the service does), timed
from its frame to the inputs the forward takes: the message decoded
(step_plan_from_message), the plan applied to the worker's table and the step's facts
derived (ModelRunner.inputs: SeqTable.apply, StepInputs.of), and the decode step's staged
integers on the device with its rows' tables gathered (gpu_worker.staging: what a graph
replay is given). The model does not run. Medians over `repeats`, in
microseconds, with the frame's bytes. Every table names blocks of a small cache (the host's
work does not depend on which blocks: memory.profile_plan does the same).
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson

from gpu_worker import runtime
from gpu_worker.buckets import smallest_fitting
from gpu_worker.protocol import WorkerConfig, encode_frame, step_plan_from_message, to_message
from gpu_worker.runner import ModelRunner
from gpu_worker.staging import gather_tables
from ops.summary import format_table
from ops.worker_steps import Seq, Steps
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model


def decode_seqs(runner: ModelRunner, batch: int, context: int) -> list[Seq]:
    """`batch` sequences of `context` tokens, each on its own run of the cache's blocks."""
    limits = runner.limits
    width = -(-context // limits.block_size)
    return [
        Seq(
            seq_id,
            [seq_id % limits.vocab_size],
            context - 1,
            [(seq_id * width + b) % limits.num_blocks for b in range(width)],
        )
        for seq_id in range(batch)
    ]


def timed(runner: ModelRunner, batch: int, context: int, repeats: int) -> list[float]:
    """[frame bytes, decode µs, inputs µs, staged µs, total µs] (medians)."""
    seqs = decode_seqs(runner, batch, context)
    steps = Steps(runner.limits.num_groups)
    runner.inputs(steps.plan(seqs, step_id=0))  # introduces them, with their tables
    frame = encode_frame(to_message("step", steps.plan(seqs, step_id=1)))
    body = frame[4:]
    bucket = smallest_fitting(batch, runner.decode_runner.buckets) or batch
    width = -(-context // runner.limits.block_size)
    staging = runner.decode_runner.staging
    parts: list[list[float]] = [[], [], []]
    for _ in range(repeats):
        began = time.perf_counter()
        plan = step_plan_from_message(orjson.loads(body))
        decoded = time.perf_counter()
        inputs = runner.inputs(plan)
        derived = time.perf_counter()
        staged = staging.send(staging.stage(inputs, bucket))
        gather_tables(inputs.held_tables, staged[2], width)
        done = time.perf_counter()
        spans = (decoded - began, derived - decoded, done - derived)
        for part, seconds in zip(parts, spans, strict=True):
            part.append(seconds * 1e6)
    medians = [statistics.median(part) for part in parts]
    runner.table.clear()
    return [float(len(frame)), *medians, sum(medians)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence bench plan", description=__doc__)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    config = WorkerConfig(
        model_dir=str(resolve_model(args.model, default_cache_dir())),
        device="cpu",
        kv_memory=float(256 * 1024 * 1024),  # a context of 8k tokens fits
        max_num_seqs=max(args.batches),
        kernel_cache=str(default_cache_dir() / "kernels.json"),
    )
    runner = runtime.start(config)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            found = timed(runner, batch, context, args.repeats)
            rows.append([str(batch), str(context), *(f"{value:.0f}" for value in found)])
    header = ["batch", "context", "frame bytes", "decode µs", "inputs µs", "staged µs", "total µs"]
    print(format_table(header, rows))
    return 0
