"""A hybrid linear-attention model's long prefill and decode steps beside a dense model of
the same width: what the Gated DeltaNet layers' state update costs on this machine.

    cadence bench hybrid [--hidden 576 --layers 24 --heads 9 --kv-heads 3 --head-dim 64]
        [--prompt 4096 --chunk 512 --context 1024 --batch 1 16 --dtype bfloat16]

Two random-weight models built with transformers' own classes and saved to a temporary
directory: Qwen3-Next with a dense MLP (three Gated DeltaNet layers to each full-attention
layer, linear heads as wide as the attention's) and a Qwen3 of the same hidden size,
layers, heads and MLP width, every layer full attention. A worker (ModelRunner) on each
prefills one `--prompt`-token prompt in chunks of `--chunk`, then decodes; and for each
`--batch`, decodes that many sequences at `--context` tokens. It prints the milliseconds
of each (the median of `--repeats` steps), and the bytes one sequence's recurrent state
holds beside the full layers' KV per token.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu_worker.protocol import WorkerConfig
from gpu_worker.runner import ModelRunner
from ops.worker_steps import Blocks, Seq, execute, prefill, tokens_of

VOCAB = 49152


def save_model(path: Path, kind: str, args: argparse.Namespace) -> Path:
    """A random-weight `kind` ("hybrid" or "dense") model of the bench's sizes at `path`."""
    import transformers

    common = dict(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=VOCAB,
        max_position_embeddings=2 * (args.prompt + args.context),
        tie_word_embeddings=True,
    )
    if kind == "hybrid":
        config = transformers.Qwen3NextConfig(
            **common,
            num_experts=0,
            linear_num_key_heads=args.kv_heads,
            linear_num_value_heads=args.heads,
            linear_key_head_dim=args.head_dim,
            linear_value_head_dim=args.head_dim,
        )
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    model.save_pretrained(path, safe_serialization=True)
    return path


def start(model_dir: Path, args: argparse.Namespace) -> ModelRunner:
    """A worker with room for every sequence the bench makes, never finished."""
    from gpu_worker import runtime

    seqs = 1 + sum(args.batch)
    tokens = args.prompt + sum(args.batch) * args.context + seqs * (args.repeats + 2)
    block_bytes = 16 * 2 * args.kv_heads * args.head_dim * 4 * args.layers
    config = WorkerConfig(
        str(model_dir),
        dtype=args.dtype,
        device="cpu",
        kv_memory=float((tokens // 16 + 2 * seqs) * block_bytes),
        max_num_seqs=seqs,
        max_num_batched_tokens=max(args.chunk, *args.batch),
    )
    return runtime.start(config)


def decode_ms(runner: ModelRunner, seqs: list[Seq], repeats: int) -> float:
    """The median of `repeats` decode steps of `seqs` (prefilled), after one to warm up."""
    times = []
    last = [5] * len(seqs)
    for step in range(repeats + 1):
        rows = [
            Seq(s.seq_id, [last[i]], s.start + len(s.tokens) + step, s.table)
            for i, s in enumerate(seqs)
        ]
        began = time.perf_counter()
        last = execute(runner, rows)
        if step:
            times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def measure(runner: ModelRunner, args: argparse.Namespace) -> dict[str, float]:
    """The bench's figures on one model's worker."""
    blocks = Blocks(runner.limits.block_size)
    room = args.repeats + 2
    prompt = Seq(1, tokens_of(args.prompt, 1, VOCAB), 0, blocks.take(args.prompt + room))
    began = time.perf_counter()
    prefill(runner, prompt, args.chunk)
    figures = {f"prefill {args.prompt}": 1000 * (time.perf_counter() - began)}
    figures[f"decode 1 at {args.prompt}"] = decode_ms(runner, [prompt], args.repeats)
    for batch in args.batch:
        seqs = [
            Seq(
                100 * batch + i,
                tokens_of(args.context, i, VOCAB),
                0,
                blocks.take(args.context + room),
            )
            for i in range(batch)
        ]
        for seq in seqs:
            prefill(runner, seq, args.chunk)
        figures[f"decode {batch} at {args.context}"] = decode_ms(runner, seqs, args.repeats)
    return figures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence bench hybrid", description=__doc__)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=24, help="a multiple of 4")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    states: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dense", "hybrid"):
            runner = start(save_model(Path(tmp) / kind, kind, args), args)
            states[kind] = 0 if runner.state is None else runner.state.bytes_per_slot
            results[kind] = measure(runner, args)
            del runner
    print(f"{'ms':<24}{'dense':>10}{'hybrid':>10}{'ratio':>8}")
    for name, dense in results["dense"].items():
        hybrid = results["hybrid"][name]
        print(f"{name:<24}{dense:>10.1f}{hybrid:>10.1f}{hybrid / dense:>8.2f}")
    print(f"recurrent state per sequence: {states['hybrid'] / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
