"""The steps a worker runs before its handshake where its attention compiles per shape
(FlexAttention on CUDA): one of each shape class serving can reach, so that no step in
service stalls for a compile (tens of seconds), and a shape that cannot compile fails the
start instead of a request.

The classes (gpu_worker.attention.flex_backend says why): prefill chunks of 2 and 3 tokens
(the first length seen is specialised, the second turns lengths dynamic), 127, 128 and 129
(one query tile or two; below 128 queries or not) and the largest a step holds, beside
decode rows in one mixed step too; decode steps at every batch bucket. Each runs on block 0
of the fresh cache, which no sequence holds yet, and samples nothing: the worker's random
stream is untouched.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpu_worker.memory import decode_profile_plan, profile_plan
from gpu_worker.protocol import StepPlan
from gpu_worker.runner import ModelRunner

CHUNK_LENGTHS = (2, 3, 127, 128, 129)
MIXED_DECODE_ROWS = 3


@torch.inference_mode()
def warm_up(runner: ModelRunner, max_batched_tokens: int) -> dict[str, Any]:
    """Runs the warm-up steps; returns the handshake's report of them."""
    started = time.perf_counter()
    plans = warm_up_plans(runner, max_batched_tokens)
    for plan in plans:
        runner.logits(runner.inputs(plan))
    runner.table.clear()
    return {"steps": len(plans), "seconds": round(time.perf_counter() - started, 3)}


def warm_up_plans(runner: ModelRunner, max_batched_tokens: int) -> list[StepPlan]:
    limits, block_size = runner.limits, runner.cache.block_size
    limit = limits.max_model_len
    longest = min(max_batched_tokens, limit)
    lengths = sorted({n for n in (*CHUNK_LENGTHS, longest) if n <= longest})
    # Each chunk starts past a cached block, as most chunks do (any offset compiles alike).
    groups = limits.num_groups
    plans = [profile_plan([n], block_size, min(limit, n + block_size), groups) for n in lengths]
    mixed = [lengths[0], *[1] * min(MIXED_DECODE_ROWS, max_batched_tokens - lengths[0])]
    plans.append(profile_plan(mixed, block_size, limit, groups))
    width = -(-limit // block_size)
    for batch in runner.decode_runner.buckets:
        plans.append(decode_profile_plan(batch, limit - 1, width, groups))
    return plans
