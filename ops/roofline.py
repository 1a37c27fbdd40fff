"""The machine's floor for a workload: how fast it could possibly run here.

    cadence bench roofline [--model DIR] [--measured-w1-seconds S] [--measured-step-ms MS]

Measures this machine's memory bandwidth (a large tensor copy) and bfloat16 matmul rate
(square matmuls), then prints, for the default model in bfloat16:
- a decode step at batch 64 (context 256..384): it must read every weight once and each
  sequence's KV cache, and do 2 flops per weight per sequence; its floor is the larger of
  bytes / bandwidth and flops / matmul rate;
- W1 (64 requests of 256 prompt tokens and 128 output tokens, all at once): the prefill
  floor plus the 128 decode steps' floors, as output tokens per second.
Given cadence's measured times, it prints them as a fraction of the floor.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.model_config import ModelConfig

BF16_BYTES = 2
W1_REQUESTS, W1_PROMPT, W1_OUTPUT = 64, 256, 128


@dataclass(frozen=True, slots=True)
class Machine:
    bandwidth: float  # bytes per second
    matmul_flops: float  # bfloat16 flops per second


@dataclass(frozen=True, slots=True)
class ModelCost:
    weight_bytes: float  # read once per step
    flops_per_token: float  # matmul flops per token, attention excluded
    kv_bytes_per_token: float  # one token's K and V over all layers
    attention_flops_per_pair: float  # per (query token, context token) pair, all layers

    @classmethod
    def of(cls, config: ModelConfig, dtype_bytes: int = BF16_BYTES) -> ModelCost:
        """The cost of `config` with weights and KV of `dtype_bytes` bytes per element."""
        h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        q_dim = config.num_attention_heads * config.head_dim
        kv_dim = config.num_key_value_heads * config.head_dim
        per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * inter
        lm_head = config.vocab_size * h
        params = layers * per_layer + lm_head  # the embedding lookup reads one row per token
        return cls(
            weight_bytes=params * dtype_bytes,
            flops_per_token=2 * params,
            kv_bytes_per_token=2 * layers * kv_dim * dtype_bytes,
            attention_flops_per_pair=4 * layers * q_dim,
        )


def step_times(
    cost: ModelCost, machine: Machine, tokens: int, kv_tokens_read: int, attention_pairs: int
) -> tuple[float, float]:
    """Seconds one step needs to read its bytes (every weight, and the KV it attends
    over), and to do its flops (the matmuls', and attention's per query-key pair)."""
    moved = cost.weight_bytes + kv_tokens_read * cost.kv_bytes_per_token
    flops = tokens * cost.flops_per_token + attention_pairs * cost.attention_flops_per_pair
    return moved / machine.bandwidth, flops / machine.matmul_flops


def step_floor(
    cost: ModelCost, machine: Machine, tokens: int, kv_tokens_read: int, attention_pairs: int
) -> float:
    """Seconds one step needs at least: its bytes or its flops, whichever takes longer."""
    return max(step_times(cost, machine, tokens, kv_tokens_read, attention_pairs))


def decode_floor(cost: ModelCost, machine: Machine, batch: int, context: int) -> float:
    return step_floor(cost, machine, batch, batch * context, batch * context)


def w1_floor(cost: ModelCost, machine: Machine) -> float:
    """Seconds W1 needs at least: the whole prefill, then one decode step per output token."""
    causal_pairs = W1_REQUESTS * W1_PROMPT * (W1_PROMPT + 1) // 2
    prefill = step_floor(
        cost, machine, W1_REQUESTS * W1_PROMPT, W1_REQUESTS * W1_PROMPT, causal_pairs
    )
    decode = sum(
        decode_floor(cost, machine, W1_REQUESTS, W1_PROMPT + t) for t in range(1, W1_OUTPUT)
    )
    return prefill + decode


def measure_bandwidth(megabytes: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second of a large copy on `device` (each byte read once and written once)."""
    src = torch.ones(megabytes * 1024 * 1024 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: the pages touched, the kernel loaded
    seconds = _best_seconds(lambda: dst.copy_(src), repeats, device)
    return 2 * src.numel() * src.element_size() / seconds


def measure_matmul(size: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """bfloat16 flops per second of square matmuls on `device`."""
    a = torch.randn(size, size, device=device).to(torch.bfloat16)
    b = torch.randn(size, size, device=device).to(torch.bfloat16)
    a @ b  # warm-up: oneDNN or cuBLAS picks and caches its kernel
    return 2 * size**3 / _best_seconds(lambda: a @ b, repeats, device)


def _best_seconds(work: Callable[[], object], repeats: int, device: str) -> float:
    """The fastest of `repeats` runs of `work`, each waited for on the device."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        work()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def report(
    cost: ModelCost, machine: Machine, w1_seconds: float | None, step_ms: float | None
) -> list[str]:
    step = decode_floor(cost, machine, W1_REQUESTS, W1_PROMPT + W1_OUTPUT // 2)
    w1 = w1_floor(cost, machine)
    lines = [
        f"memory bandwidth      {machine.bandwidth / 1e9:8.1f} GB/s",
        f"bf16 matmul           {machine.matmul_flops / 1e12:8.2f} TFLOP/s",
        f"weights (bf16)        {cost.weight_bytes / 1e6:8.1f} MB, "
        f"KV {cost.kv_bytes_per_token / 1e3:.1f} KB per token",
        f"decode step, batch {W1_REQUESTS}, context {W1_PROMPT + W1_OUTPUT // 2}: "
        f"floor {step * 1e3:.1f} ms" + _versus(step, step_ms and step_ms / 1e3),
        f"W1 ({W1_REQUESTS} x {W1_PROMPT} in, {W1_OUTPUT} out): floor {w1:.2f} s = "
        f"{W1_REQUESTS * W1_OUTPUT / w1:.0f} out tok/s" + _versus(w1, w1_seconds),
    ]
    return lines


def _versus(floor: float, measured: float | None) -> str:
    if not measured:
        return ""
    return f"; measured {measured:.4g} s: {floor / measured:.0%} of the floor's speed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cadence bench roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="model directory (default model)")
    parser.add_argument("--measured-w1-seconds", type=float, default=None)
    parser.add_argument("--measured-step-ms", type=float, default=None)
    parser.add_argument("--copy-megabytes", type=int, default=512)
    parser.add_argument("--matmul-size", type=int, default=2048)
    args = parser.parse_args(argv)
    from service.config import default_cache_dir
    from service.model_files.resolve import resolve_model

    config = ModelConfig.from_dir(resolve_model(args.model, default_cache_dir()))
    machine = Machine(measure_bandwidth(args.copy_megabytes), measure_matmul(args.matmul_size))
    for line in report(
        ModelCost.of(config), machine, args.measured_w1_seconds, args.measured_step_ms
    ):
        print(line)
    return 0
