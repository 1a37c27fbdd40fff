"""Sampler benchmark: the cost of sampling one step's logits under each sampling setting.

    cadence bench sampler [--rows 64] [--vocab 49152] [--repeats 20] [--threads 1]

Prints the median and best time per call for greedy, temperature, top-k, top-p and seeded
sampling of `rows` x `vocab` random logits on the CPU (the default model's vocabulary), in a
process whose freed memory stays in its heap, as the worker's (gpu_worker.process).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker.process import keep_freed_memory
from gpu_worker.protocol import SamplingSpec
from gpu_worker.sampler import Sampler

SETTINGS = {
    "greedy": SamplingSpec(),
    "temperature 0.8": SamplingSpec(temperature=0.8),
    "top-k 50": SamplingSpec(temperature=0.8, top_k=50),
    "top-p 0.9": SamplingSpec(temperature=0.8, top_p=0.9),
    "seeded": SamplingSpec(temperature=0.8, seed=7),
}


def time_setting(sampler: Sampler, logits: torch.Tensor, spec: SamplingSpec, repeats: int):
    rows = logits.shape[0]
    sampler.sample(logits, [spec] * rows, list(range(rows)))  # warm-up
    costs = []
    for _ in range(repeats):
        started = time.perf_counter()
        sampler.sample(logits, [spec] * rows, list(range(rows)))
        costs.append((time.perf_counter() - started) * 1000)
    return statistics.median(costs), min(costs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence bench sampler", description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the worker process does: else page faults dominate the times
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 6
    sampler = Sampler(0, torch.device("cpu"))
    print(f"sampling {args.rows} x {args.vocab} logits, {args.threads} thread(s)")
    for name, spec in SETTINGS.items():
        median, best = time_setting(sampler, logits, spec, args.repeats)
        print(f"{name:>16}: median {median:6.2f} ms, best {best:6.2f} ms")
    return 0
