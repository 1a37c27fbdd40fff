"""What a disaggregated handover costs: a prompt's K/V pulled from a producer's cache into
a consumer's with Mooncake's transfer engine (loopback TCP), against computing the prompt.

    python -m ops.pd_bench [--model DIR] [--dtype bfloat16] [--prompt-tokens 1024]
        [--kv-memory 1e9] [--requests 200] [--repeats 5]

Two workers of the model, each with its connector (as `cadence serve --kv-transfer-role
producer` and `consumer` have), in this process. The producer computes the prompt in chunks
of the worker's step size (its prefill time); the consumer pulls its blocks (the pull time:
submitted to done, the producer notified), --repeats times each. Printed for a fresh cache
(each side's blocks consecutive: one segment per cache tensor and KV head) and for a
fragmented one: both sides' block managers (the service's own, prefix caching on) first
serve --requests mixed requests (prompts of 16 to 1,500 tokens, 16 to 256 generated, up
to 16 at once, each admitted while its whole life fits), so the prompt's blocks are what
such a cache hands out next. Each is pulled twice: from the producer's cache (unstaged),
and staged (gpu_worker.kv_staging: the producer gathers the prompt into its arena, as the
step that ends the request does, and the consumer reads that region in one segment, or
straight into its blocks when they are one run). For each: blocks, runs (of blocks
consecutive on both sides), segments, bytes moved against blocks x block bytes, the
gather's median time (staged), the pull's and its GB/s, the prefill's, and the pull as a
share of it. The pulled blocks are compared with the producer's, bit for bit (the
consumer's are zeroed before each way). Mooncake's own log lines go to stderr.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker import runtime
from gpu_worker.kv_connector import KvConnector, cache_tensors
from gpu_worker.protocol import KV_ENGINE_MOONCAKE, KvPull, KvStage, PullDone, WorkerConfig
from gpu_worker.runner import ModelRunner
from ops.worker_steps import Seq, prefill, tokens_of
from service.config import default_cache_dir
from service.engine.block_manager import BlockManager, chain_hashes
from service.model_files.resolve import resolve_model

PROMPT_SEQ = 0  # the measured prompt's sequence, on both sides
MAX_RUNNING = 16


@dataclass(slots=True)
class Side:
    runner: ModelRunner
    blocks: BlockManager
    chunk: int  # the most tokens a step computes (the server's default cap)

    @property
    def kv(self) -> KvConnector:
        assert self.runner.kv is not None  # started with a transfer engine
        return self.runner.kv


@dataclass(slots=True)
class Measured:
    blocks: int
    done: PullDone
    pull_s: float  # median
    prefill_s: float  # median
    identical: bool
    stage_s: float | None = None  # the gather's median; None: unstaged


def start_side(model_dir: Path, args: argparse.Namespace) -> Side:
    config = WorkerConfig(
        model_dir=str(model_dir),
        dtype=args.dtype,
        device="cpu",
        kv_memory=args.kv_memory,
        kernel_cache=str(default_cache_dir() / "kernels.json"),
        kv_transfer_engine=KV_ENGINE_MOONCAKE,
        kv_staging_tokens=args.prompt_tokens,
    )
    runner = runtime.start(config)
    cache = runner.cache
    blocks = BlockManager(cache.num_blocks, cache.block_size)
    return Side(runner, blocks, config.max_num_batched_tokens)


def block_bytes(runner: ModelRunner) -> int:
    """A block's bytes over every cache tensor and KV head: what a pull moves per block."""
    return sum(t.shape[0] * t.stride(1) * t.element_size() for t in cache_tensors(runner.cache))


def fragment(blocks: BlockManager, requests: int, seed: int) -> None:
    """`requests` mixed requests through `blocks` as a server's scheduler takes them: a
    prompt's blocks at admission (while its whole life fits), its full blocks registered in
    the prefix cache, a block more at each boundary as it decodes, all freed at its end."""
    rng = random.Random(seed)
    running: dict[int, list[int]] = {}  # seq id -> [tokens so far, tokens still to come]
    arrived = 0
    while arrived < requests or running:
        while arrived < requests and len(running) < MAX_RUNNING:
            prompt = rng.choice((rng.randint(16, 128), rng.randint(256, 1500)))
            generated = rng.randint(16, 256)
            owed = sum(blocks.extra_blocks(s, sum(life)) for s, life in running.items())
            if blocks.blocks_to_hold(prompt + generated) + owed > blocks.num_free:
                break
            seq_id = PROMPT_SEQ + 1 + arrived
            blocks.allocate(seq_id, prompt)
            tokens = [rng.randrange(3, 30000) for _ in range(prompt)]
            blocks.register(seq_id, chain_hashes(tokens, blocks.block_size, []), prompt)
            running[seq_id] = [prompt, generated]
            arrived += 1
        for seq_id, life in list(running.items()):
            life[0], life[1] = life[0] + 1, life[1] - 1
            blocks.allocate(seq_id, life[0])
            if life[1] == 0:
                blocks.free(seq_id)
                del running[seq_id]


def timed_prefill(side: Side, tokens: list[int], repeats: int) -> float:
    """The prompt computed into its blocks, in steps of the worker's size; median seconds."""
    table = side.blocks.table(PROMPT_SEQ)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        prefill(side.runner, Seq(PROMPT_SEQ, tokens, 0, table), side.chunk)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def timed_stage(producer: Side, repeats: int) -> float:
    """The prompt gathered into the arena's first blocks; median seconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        producer.kv.stage([KvStage(producer.blocks.table(PROMPT_SEQ), 0)])
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def timed_pulls(
    producer: Side, consumer: Side, repeats: int, staged: bool
) -> tuple[PullDone, float]:
    """The prompt's blocks pulled `repeats` times (from the arena's first blocks where
    `staged`); the last pull's report, median seconds."""
    times, done = [], None
    for attempt in range(repeats):
        pull = KvPull(
            f"bench-{attempt}",
            producer.kv.address,
            producer.blocks.table(PROMPT_SEQ),
            consumer.blocks.table(PROMPT_SEQ),
            producer.kv.addresses,
            producer.runner.cache.num_blocks,
            producer.kv.staging_address if staged else None,
        )
        started = time.perf_counter()
        consumer.kv.submit([pull])
        while not (ended := consumer.kv.poll_done()):
            time.sleep(0.0002)
        times.append(time.perf_counter() - started)
        done = ended[0]
        if done.error is not None:
            raise RuntimeError(f"the pull failed: {done.error}")
    producer.kv.poll_notices()  # the notices of the pulls above, drained
    assert done is not None
    return done, statistics.median(times)


def pulled_identical(producer: Side, consumer: Side) -> bool:
    remote, local = producer.blocks.table(PROMPT_SEQ), consumer.blocks.table(PROMPT_SEQ)
    pairs = zip(
        cache_tensors(producer.runner.cache), cache_tensors(consumer.runner.cache), strict=True
    )
    return all(torch.equal(theirs[:, remote], mine[:, local]) for theirs, mine in pairs)


def zero_pulled(consumer: Side) -> None:
    """The consumer's blocks of the prompt cleared: a pull must write them all again."""
    local = consumer.blocks.table(PROMPT_SEQ)
    for tensor in cache_tensors(consumer.runner.cache):
        tensor[:, local] = 0


def measure(producer: Side, consumer: Side, tokens: list[int], repeats: int) -> list[Measured]:
    """The prompt pulled unstaged, then staged."""
    for side in (producer, consumer):
        side.blocks.allocate(PROMPT_SEQ, len(tokens))
    prefill_s = timed_prefill(producer, tokens, repeats)
    count = len(producer.blocks.table(PROMPT_SEQ))
    measured = []
    for staged in (False, True):
        zero_pulled(consumer)
        stage_s = timed_stage(producer, repeats) if staged else None
        done, pull_s = timed_pulls(producer, consumer, repeats, staged)
        identical = pulled_identical(producer, consumer)
        measured.append(Measured(count, done, pull_s, prefill_s, identical, stage_s))
    for side in (producer, consumer):
        side.blocks.free(PROMPT_SEQ)
    return measured


def report(name: str, measured: Measured, per_block: int, per_run: int) -> None:
    """One line; per_run: the segments of a run of consecutive blocks (tensors x heads)."""
    done = measured.done
    expected = measured.blocks * per_block
    runs = "-" if measured.stage_s is not None else str(done.segments // per_run)
    stage = "-" if measured.stage_s is None else f"{measured.stage_s * 1e3:.2f}"
    print(
        f"{name:17} {measured.blocks:6} {runs:>5} {done.segments:8} "
        f"{done.bytes:12,} {expected:12,} "
        f"{'yes' if done.bytes == expected else 'NO':>5} {stage:>8} {measured.pull_s * 1e3:9.2f} "
        f"{done.bytes / measured.pull_s / 1e9:7.2f} {measured.prefill_s * 1e3:10.1f} "
        f"{measured.pull_s / measured.prefill_s:8.2%} {'yes' if measured.identical else 'NO':>9}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ops.pd_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--kv-memory", type=float, default=1e9, help="bytes, each side's cache")
    parser.add_argument("--requests", type=int, default=200, help="before the fragmented run")
    parser.add_argument("--repeats", type=int, default=5, help="pulls and prefills, each")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = resolve_model(args.model, default_cache_dir())
    producer, consumer = start_side(model_dir, args), start_side(model_dir, args)
    per_block = block_bytes(producer.runner)
    per_run = sum(t.shape[0] for t in cache_tensors(producer.runner.cache))
    tokens = tokens_of(args.prompt_tokens, args.seed, producer.runner.limits.vocab_size)
    print(
        f"{model_dir.name}, {args.dtype}: a {args.prompt_tokens}-token prompt; blocks of "
        f"{producer.blocks.block_size} tokens, {per_block:,} bytes each over "
        f"{len(cache_tensors(producer.runner.cache))} cache tensors; caches of "
        f"{producer.blocks.num_blocks} blocks; medians of {args.repeats}"
    )
    print(
        "cache             blocks  runs segments        bytes  blocks x B equal stage ms  "
        "pull ms    GB/s prefill ms pull/pre identical"
    )
    for name in ("fresh", f"{args.requests} reqs"):
        if name != "fresh":
            for offset, side in enumerate((producer, consumer)):
                fragment(side.blocks, args.requests, args.seed + 1 + offset)
        unstaged, staged = measure(producer, consumer, tokens, args.repeats)
        report(name, unstaged, per_block, per_run)
        report(f"{name}, staged", staged, per_block, per_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
