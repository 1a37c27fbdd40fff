"""What the LoRA adapter path costs a worker's steps: decode steps at each `--batch` and a
prefill chunk, with the sequences spread over 0 (the base), 1, 4 and 8 adapters.

    cadence bench lora [--model DIR] [--rank 16] [--adapters 0 1 4 8] [--batch 1 64]
        [--context 64 --chunk 256 --repeats 10 --dtype bfloat16 --device cpu]

Random adapters of rank `--rank` on all seven projections, written in PEFT's format to a
temporary directory, loaded into one worker with max(--adapters) slots; the default
model (SmolLM2-135M-Instruct) unless `--model`. Each batch's sequences take the adapters
round-robin (0: every one the base). It prints the median milliseconds of `--repeats`
steps of each, their ratio to the base, and the bytes each adapter slot holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu_worker import runtime
from gpu_worker.lora_files import TARGET_MODULES, module_shape, tensor_name
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import AdapterLoad, StepPlan, WorkerConfig
from gpu_worker.runner import ModelRunner
from ops.worker_steps import Blocks, Seq, execute, tokens_of
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every target module at `path`."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in TARGET_MODULES:
            out, inp = module_shape(config, layer, module)
            a = torch.randn((rank, inp), generator=generator) / inp**0.5
            tensors[tensor_name(layer, module, "A")] = a
            tensors[tensor_name(layer, module, "B")] = (
                torch.randn((out, rank), generator=generator) / rank**0.5
            )
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    settings = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


def start(model_dir: Path, args: argparse.Namespace) -> ModelRunner:
    """A worker with room for every sequence the bench makes, never finished."""
    seqs = len(args.adapters) * (sum(args.batch) + 1)
    tokens = seqs * (args.context + args.repeats + 2) + len(args.adapters) * args.chunk
    config = WorkerConfig(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        kv_memory=float(tokens * 64 * 1024),  # 60 KiB a token is a 135M model's float32 KV
        max_num_seqs=max(args.batch) + 1,
        max_num_batched_tokens=max(args.chunk, args.context * max(args.batch)),
        max_loras=max(args.adapters),
        max_lora_rank=args.rank,
    )
    return runtime.start(config)


def names(count: int, batch: int) -> list[str | None]:
    """Each of `batch` sequences' adapter, round-robin over `count` (0: the base)."""
    return [None if not count else f"a{i % count}" for i in range(batch)]


def step_ms(runner: ModelRunner, steps: list[list[Seq]]) -> float:
    """The median of the steps' times, the first one (a warm-up) left out."""
    times = []
    for seqs in steps:
        began = time.perf_counter()
        execute(runner, seqs)
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times[1:])


def measure(runner: ModelRunner, count: int, args: argparse.Namespace, blocks: Blocks) -> dict:
    figures = {}
    vocab, room = runner.model.config.vocab_size, args.context + args.repeats + 2
    for batch in args.batch:
        seqs = [
            Seq(
                1000 * count + 100 * batch + i,
                tokens_of(args.context, i, vocab),
                0,
                blocks.take(room),
                adapter=name,
            )
            for i, name in enumerate(names(count, batch))
        ]
        execute(runner, seqs)  # their prompts, in one step
        decodes = [
            [Seq(s.seq_id, [5], args.context + step, s.table, adapter=s.adapter) for s in seqs]
            for step in range(args.repeats + 1)
        ]
        figures[f"decode batch {batch}"] = step_ms(runner, decodes)
    prompt, table = tokens_of(args.chunk, 7, vocab), blocks.take(args.chunk)
    chunk = Seq(1000 * count + 99, prompt, 0, table, adapter=names(count, 1)[0])
    figures[f"prefill {args.chunk}"] = step_ms(runner, [[chunk]] * (args.repeats + 1))
    return figures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence bench lora", description=__doc__)
    parser.add_argument("--model", default=None, help="a model directory (default model)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cpu")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.adapters = list(dict.fromkeys(args.adapters))  # each count once: its own sequences
    model_dir = Path(args.model) if args.model else resolve_model(None, default_cache_dir())
    config = ModelConfig.from_dir(model_dir)
    runner = start(model_dir, args)
    assert runner.model.lora is not None
    results = {}
    blocks = Blocks(runner.limits.block_size)
    with tempfile.TemporaryDirectory() as tmp:
        loads = [
            AdapterLoad(i, f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", config, args.rank, i)))
            for i in range(max(args.adapters))
        ]
        result = runner.execute(StepPlan(0, [], [], adapters=loads))
        if result.error is not None:
            raise RuntimeError(result.error)
        for count in args.adapters:
            results[count] = measure(runner, count, args, blocks)
    base = results[args.adapters[0]]
    print(f"{'ms':<20}" + "".join(f"{f'{count} adapters':>13}" for count in args.adapters))
    for name, first in base.items():
        row = "".join(
            f"{results[c][name]:>7.1f} x{results[c][name] / first:<4.2f}" for c in args.adapters
        )
        print(f"{name:<20}{row}")
    slot = runner.model.lora.bytes_per_slot
    print(
        f"bytes per adapter slot (rank {args.rank}, {args.dtype}): {slot} ({slot / 2**20:.2f} MiB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
