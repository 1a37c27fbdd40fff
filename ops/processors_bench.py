"""What vLLM's sampling parameters cost a decode step, on the default model.

    cadence bench processors [--rows 64] [--prompt 256] [--steps 24] [--dtype bfloat16]

Two batches of W1's shape (`rows` sequences of `prompt` tokens, decoding), alternating step
by step in one run (ABBA) so that a shared, noisy machine slows both alike: "free", where no row
asks for a logit processor, and "quarter", where every fourth row has presence, frequency
and repetition penalties and a logit_bias of 8 tokens (its history kept by the worker).
Prints each batch's median step (forward, sampling, history counts) and their ratio; then,
since the forward's noise on a shared machine hides a small difference, the processors'
own work timed alone on each batch's plan and logits (the histories' update and the logit
processors; alternating, medians), as a share of the free step: for the free batch it is
only the checks that find nothing to do.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker import runtime
from gpu_worker.logit_processors import apply_min_p
from gpu_worker.protocol import SamplingSpec, StepPlan, WorkerConfig
from gpu_worker.runner import ModelRunner
from gpu_worker.sampler import Logits, with_processors
from ops.worker_steps import Seq, plan_of, steps_for, tokens_of
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model

FREE = SamplingSpec()  # greedy, as W1 (ops.engine_bench): the cheapest step to add to
PENALISED = SamplingSpec(
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logit_bias=[(t, 2.0) for t in range(1000, 1008)],
)


class Batch:
    """Sequences decoding together, one per spec, with random prompts."""

    def __init__(self, runner: ModelRunner, specs: list[SamplingSpec], prompt: int, seq0: int):
        self.runner, self.specs = runner, specs
        vocab = runner.limits.vocab_size
        self.seqs = [
            Seq(
                seq0 + i,
                tokens_of(prompt, seed=seq0 + i, vocab=vocab),
                0,
                [],
                spec=spec,
                prompt_len=prompt,
            )
            for i, spec in enumerate(specs)
        ]

    def prefill(self, first_block: int, capacity: int, chunk_rows: int) -> int:
        """Prefills the prompts, each in blocks for `capacity` tokens from `first_block`
        on, `chunk_rows` sequences a step; returns the first block left."""
        per_seq = -(-capacity // self.runner.cache.block_size)
        for i, seq in enumerate(self.seqs):
            seq.table = list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
        for first in range(0, len(self.seqs), chunk_rows):
            part = self.seqs[first : first + chunk_rows]
            self._advance(part, steps_for(self.runner).plan(part))
        return first_block + len(self.seqs) * per_seq

    def decode(self) -> float:
        """One decode step of every row; its ms."""
        started = time.perf_counter()
        self._advance(self.seqs, steps_for(self.runner).plan(self.seqs))
        return (time.perf_counter() - started) * 1000

    def _advance(self, seqs: list[Seq], plan: StepPlan) -> None:
        result = self.runner.execute(plan)
        assert result.error is None, result.error
        for seq, tokens in zip(seqs, result.tokens, strict=True):
            seq.start += len(seq.tokens)
            seq.tokens = tokens


def processors_us(runner: ModelRunner, free: Batch, quarter: Batch, repeats: int = 100):
    """Median µs of the processors' own work on one step of each batch, alternating: the
    histories' count of its plan, then the logit processors (with_processors) on its
    logits. For the free batch that is only the checks that find nothing to do."""
    rows = len(free.seqs)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(rows, runner.limits.vocab_size, generator=generator) * 4
    logits = Logits(values.to(runner.model.dtype))
    times: dict[str, list[float]] = {"free": [], "quarter": []}
    for _ in range(repeats):
        for name, batch in (("free", free), ("quarter", quarter)):
            plan = plan_of(batch.seqs)  # counted, not run: what the worker holds is unchanged
            seq_ids = [seq.seq_id for seq in batch.seqs]
            histories = runner.table.histories
            started = time.perf_counter()
            histories.count_step(plan)
            history = histories.rows(seq_ids)
            with_processors(logits, None, batch.specs, history)
            apply_min_p(values, [spec.min_p for spec in batch.specs])
            times[name].append((time.perf_counter() - started) * 1e6)
    return statistics.median(times["free"]), statistics.median(times["quarter"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence bench processors", description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    config = WorkerConfig(
        model_dir=str(resolve_model(None, default_cache_dir())),
        dtype=args.dtype,
        device="cpu",
        # the default model's K and V: 30 layers x 3 heads x 64, in float32 at most
        kv_memory=float(2 * args.rows * (args.prompt + args.steps + 32) * 30 * 2 * 192 * 4),
        max_num_batched_tokens=max(512, args.prompt * 2),
    )
    runner = runtime.start(config)
    free = Batch(runner, [FREE] * args.rows, args.prompt, seq0=0)
    quarter_specs = [PENALISED if i % 4 == 0 else FREE for i in range(args.rows)]
    quarter = Batch(runner, quarter_specs, args.prompt, seq0=args.rows)
    capacity = args.prompt + args.steps + 2
    chunk_rows = max(1, config.max_num_batched_tokens // args.prompt)
    quarter.prefill(free.prefill(0, capacity, chunk_rows), capacity, chunk_rows)
    times: dict[str, list[float]] = {"free": [], "quarter": []}
    batches = {"free": free, "quarter": quarter}
    for step in range(args.steps):  # alternating (ABBA), so that noise hits both alike
        for name in ("free", "quarter") if step % 2 == 0 else ("quarter", "free"):
            times[name].append(batches[name].decode())
    ratios = [q / f for f, q in zip(times["free"], times["quarter"], strict=True)]
    free_ms, quarter_ms = (statistics.median(times[k]) for k in ("free", "quarter"))
    free_us, quarter_us = processors_us(runner, free, quarter)
    print(f"decode steps of {args.rows} rows at {args.prompt}+ tokens, {args.dtype}, CPU")
    print(f"  free (no row asks):          median {free_ms:7.2f} ms")
    print(f"  quarter (penalties + bias):  median {quarter_ms:7.2f} ms")
    print(
        f"  quarter / free: median of step ratios {statistics.median(ratios):.3f}, "
        f"ratio of medians {quarter_ms / free_ms:.3f}"
    )
    for name, cost in (("free", free_us), ("quarter", quarter_us)):
        share = cost / 10 / free_ms  # µs / (ms x 1000) x 100
        print(f"  processors' own work, {name:>7}: {cost:8.1f} µs = {share:.3f} % of a free step")
    return 0
