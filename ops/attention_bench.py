"""The attention backends offered on this CPU, timed on a model's attention shapes.

    cadence bench attention [--heads 64 --kv-heads 8 --head-dim 64 --window 128 --sinks]
        [--layers 24] [--batch 16] [--context 1024] [--chunk 256] [--dtype bfloat16]

By default gpt-oss-20b's: 64 query heads over 8 key/value heads of 64, attention sinks,
layers alternating a 128-token window and full attention. For each backend the chooser
would offer for those layers (gpu_worker.kernels), it times a decode step (`--batch`
rows, contexts within 128 of `--context`) and a prompt chunk of `--chunk` tokens after
`--context` cached ones, through every layer, and prints each one's milliseconds (the best
of `--repeats`). The inputs are the kernel chooser's own (kernel_choice.attention_case),
with the model's windows as they are rather than cut for the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from functools import partial

import torch

from gpu_worker import kernels
from gpu_worker.attention import AttentionBackend, LayerAttention
from gpu_worker.kernel_choice import AttentionCase, Shapes, attention_case, run_decode, run_prefill

CPU = torch.device("cpu")


def layer_kinds(window: int | None, sinks: bool) -> tuple[LayerAttention, ...]:
    """gpt-oss's pattern: a windowed layer then a full one (only full ones without a window)."""
    full = LayerAttention(sinks=sinks)
    return (full,) if window is None else (LayerAttention(window=window, sinks=sinks), full)


def best_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def step_ms(
    backend: AttentionBackend, cases: list[AttentionCase], layers: int, repeats: int
) -> tuple[float, float]:
    """A decode step's and a chunk's attention over `layers` layers, the kinds alternating."""
    decode = sum(best_ms(partial(run_decode, backend, case), repeats) for case in cases)
    prefill = sum(best_ms(partial(run_prefill, backend, case), repeats) for case in cases)
    return decode * layers / len(cases), prefill * layers / len(cases)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence bench attention", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=128, help="0: every layer attends in full")
    parser.add_argument("--sinks", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    kinds = layer_kinds(args.window or None, args.sinks)
    hidden = args.heads * args.head_dim
    shapes = Shapes(
        args.heads, args.kv_heads, args.head_dim, hidden, hidden, args.block_size, dtype, CPU, dtype
    )
    case = attention_case(shapes, batch=args.batch, chunk=args.chunk, start=args.context)
    sinks = None
    if args.sinks:  # as the chooser draws them: near the rows' log-sum-exps
        sinks = 6 + 2 * torch.randn(args.heads, generator=torch.Generator().manual_seed(1))
        sinks = sinks.to(dtype)
    cases = [dataclasses.replace(case, layer=kind, sinks=sinks) for kind in kinds]
    offered = kernels.attention_candidates(CPU, dtype, args.head_dim, kinds)
    print(
        f"{args.layers} layers {[dataclasses.astuple(k) for k in kinds]} (scale, window, "
        f"softcap, sinks); {args.heads}/{args.kv_heads} heads of {args.head_dim}, {args.dtype}, "
        f"{torch.get_num_threads()} threads; decode batch {args.batch} at ~{args.context}, "
        f"chunk {args.chunk} after {args.context}"
    )
    print(f"{'backend':<12} {'decode step ms':>15} {'chunk ms':>10}")
    for backend in offered:
        decode, prefill = step_ms(backend, cases, args.layers, args.repeats)
        print(f"{backend.name:<12} {decode:>15.2f} {prefill:>10.2f}")
    return 0
