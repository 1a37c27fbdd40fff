"""How much device memory the KV cache may take, measured after a profiling step on CUDA.

On CUDA the cache is sized only after the largest steps the worker accepts have run once
on a one-block cache: their peak activations (and, when decode graphs are captured, the
graph pool's, which holds the largest decode step's) come off the free memory before
--kv-memory's fraction applies (kv_cache.budget_bytes says how this differs from vLLM's
gpu_memory_utilization). Measured before any forward pass, free memory would count the
activations as cache, and --kv-memory 0.9 would run out of memory on the first long step.

On a CPU the budget stays a fraction of MemAvailable, as before: activations there come
from the same RAM and are small beside it, and there is no allocator to read a peak from.

Only `peak_bytes` and `release_cached` call CUDA; the plans are plain data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.device import free_memory_bytes
from gpu_worker.protocol import NewSeq, Row, SamplingSpec, StepPlan

# The costliest sampling path: a full sort for top-p, and float32 log-probabilities.
PROFILE_SAMPLING = SamplingSpec(temperature=1.0, top_p=0.9, logprobs=True, top_logprobs=20)


def profile_lengths(max_tokens: int, max_seqs: int, context_limit: int) -> list[int]:
    """Token counts of the largest mixed step: prefill chunks of at most context_limit
    tokens, then as many one-token rows as max_seqs allows, max_tokens in all."""
    decodes = max(0, min(max_seqs - 1, max_tokens - 1))
    rest = max_tokens - decodes
    chunks = [context_limit] * (rest // context_limit)
    if rest % context_limit:
        chunks.append(rest % context_limit)
    return chunks + [1] * decodes


def profile_plan(
    lengths: list[int], block_size: int, context_limit: int, num_groups: int = 1
) -> StepPlan:
    """A plan of sequences of `lengths` tokens whose tables (in each of `num_groups` KV
    groups) all name block 0: activations depend on shapes, not on which blocks hold the
    data, so one block serves them all. Chunks end at context_limit, where their attention
    reads the most."""
    starts = [context_limit - n if n > 1 else 0 for n in lengths]
    tables = [[0] * -(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True)]
    return trial_plan(lengths, starts, tables, PROFILE_SAMPLING, num_groups)


def decode_profile_plan(batch: int, position: int, width: int, num_groups: int = 1) -> StepPlan:
    """`batch` decode rows at `position`, each reading a table of `width` blocks (in each
    of `num_groups` KV groups), all block 0."""
    return trial_plan(
        [1] * batch, [position] * batch, [[0] * width] * batch, SamplingSpec(), num_groups
    )


def trial_plan(
    lengths: list[int],
    starts: list[int],
    tables: list[list[int]],
    sampling: SamplingSpec,
    num_groups: int = 1,
) -> StepPlan:
    """A plan that stands alone: sequences 0, 1, ... introduced afresh (whatever the worker
    held of those ids before), each sampling after `lengths[i]` tokens from starts[i] over
    tables[i] in every KV group. The start-up's trial steps; the worker forgets them
    before serving (SeqTable.clear)."""
    ids = list(range(len(lengths)))
    rows = [
        Row(i, n, start, blocks=[table] * num_groups, blocks_at=0)
        for i, n, start, table in zip(ids, lengths, starts, tables, strict=True)
    ]
    new = [
        NewSeq(i, sampling, prompt_len=start + n)
        for i, n, start in zip(ids, lengths, starts, strict=True)
    ]
    return StepPlan(-1, rows, [0] * sum(lengths), new=new, finished=ids)


def peak_bytes(device: torch.device, step: Callable[[], object]) -> int:
    """The bytes `step` allocates at its peak beyond what was allocated before it (CUDA)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def settled_free_bytes(device: torch.device) -> int:
    """Free device memory once the allocator has returned its cached, unused blocks."""
    release_cached(device)
    return free_memory_bytes(device)


def release_cached(device: torch.device) -> None:
    """Returns the allocator's cached, unused blocks (graph warm-ups leave some on a side
    stream, where eager steps could never reuse them)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
