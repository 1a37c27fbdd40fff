"""Quantized matmul benchmark: gpt-oss's MXFP4 expert matmuls beside bfloat16 ones.

    cadence bench quant [--repeats 50] [--threads 1] [--rows 1 64] [--weights 8]

Prints the median and best time per call of x [rows, K] against a weight [N, K] of the
shapes of a gpt-oss-20b expert (down: 2880 x 2880; gate_up: 5760 x 2880), with the weight
in MXFP4 (gpu_worker.quant's C++ kernel, 4.25 bits a weight) and in bfloat16 (cadence's own
kernel where the CPU has AVX512-BF16, oneDNN's), the activations in bfloat16 as the
worker's. Each call takes the next of `weights` weights of the shape, as a decode step's
experts follow each other: their bytes stream from memory (8 gate_up weights are 64 MB in
MXFP4, 265 MB in bfloat16), where one weight called again would sit in the caches. The
weights are random; no kernel's time depends on their values.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from gpu_worker.kernels import quant_kernels
from gpu_worker.linear import Linear
from gpu_worker.process import keep_freed_memory
from gpu_worker.quant import QuantLinear, QuantWeight, e8m0_scales

SHAPES = {"down 2880 x 2880": (2880, 2880), "gate_up 5760 x 2880": (5760, 2880)}
BF16_KERNELS = ("native", "onednn")


def random_mxfp4(n: int, k: int, seed: int) -> QuantWeight:
    """E2M1 codes and E8M0 scales around a trained model's (2^-6 .. 2^-3)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    exponents = torch.randint(121, 125, (n, k // 32), generator=generator, dtype=torch.uint8)
    return QuantWeight("mxfp4", codes, e8m0_scales(exponents), None, 32)


def time_calls(calls: Sequence[Callable[[], torch.Tensor]], repeats: int) -> tuple[float, float]:
    """Median and best milliseconds per call, the calls taken in turn, after a round of
    warm-up."""
    for call in calls:
        call()
    costs = []
    for i in range(repeats):
        started = time.perf_counter()
        calls[i % len(calls)]()
        costs.append((time.perf_counter() - started) * 1000)
    return statistics.median(costs), min(costs)


def matmuls(weight: QuantWeight, rows: tuple[int, ...]) -> dict[str, QuantLinear | Linear]:
    """The weight as each kernel serves it, by name: mxfp4, then bfloat16's (a kernel that
    cannot serve it here gives way to the next: named as the one that does)."""
    native = quant_kernels(torch.device("cpu"))
    if native is None:
        raise SystemExit("the quantized C++ kernel is not built on this machine")
    bias = torch.zeros(weight.values.shape[0], dtype=torch.bfloat16)
    served: dict[str, QuantLinear | Linear] = {
        "mxfp4 (cadence)": QuantLinear(
            [weight], bias, native=native, dtype=torch.bfloat16, sizes=rows
        )
    }
    dense = weight.dequantize().bfloat16()
    for kernel in BF16_KERNELS:
        linear = Linear(dense, bias, kernel=kernel, sizes=rows)
        served.setdefault(f"bfloat16 ({linear.kind})", linear)
    return served


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence bench quant", description=__doc__)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--weights", type=int, default=8)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the worker process does: else page faults dominate the times
    torch.set_num_threads(args.threads)
    rows = tuple(sorted(args.rows))
    print(f"ms per call (median / best of {args.repeats}), {args.threads} thread(s)")
    for shape_name, (n, k) in SHAPES.items():
        served = [matmuls(random_mxfp4(n, k, seed), rows) for seed in range(args.weights)]
        for name in served[0]:
            for count in rows:
                x = torch.randn(count, k, generator=torch.Generator().manual_seed(count))
                x = x.bfloat16()
                calls = [functools.partial(each[name], x) for each in served]
                median, best = time_calls(calls, args.repeats)
                print(
                    f"{shape_name:>20} {name:>18} {count:>4} rows: {median:8.3f} / {best:8.3f} ms"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
