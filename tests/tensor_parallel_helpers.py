"""What the tensor-parallel tests share (tests/test_tensor_parallel.py on tiny models,
tests/test_tensor_parallel_real.py on the default model): a runner over one rank's shard
of a model, and ranks spawned over gloo, each running one function, rank 0's result
handed back to the test."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_worker import kv_cache, runtime
from gpu_worker.checkpoint import load_weights
from gpu_worker.kernels import Kernels, candidates, quant_kernels
from gpu_worker.model import Model
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import WorkerConfig
from gpu_worker.runner import ModelRunner
from gpu_worker.tensor_parallel import Shard
from tests.worker_fixtures import BLOCK_SIZE

CPU = torch.device("cpu")
NUM_BLOCKS = 256  # Gemma 3's three KV groups spread each table's blocks three ways
COLLECTIVE_TIMEOUT_S = 60
RANKS_TIMEOUT_S = 300


def kernels_for(config: ModelConfig, dtype: torch.dtype) -> Kernels:
    """The last candidate of each seam (the native CPU kernels where they build), so
    that the parent and the ranks run the same ones without measuring."""
    offered = candidates(CPU, dtype, config.head_dim)
    return Kernels(offered["attention"][-1], offered["layer_ops"][-1], offered["matmul"][-1])


def build_runner(
    model_dir: Path, dtype: torch.dtype, shard: Shard, quantization: str = "none"
) -> ModelRunner:
    config = ModelConfig.from_dir(model_dir)
    kernels = kernels_for(config, dtype)
    if quantization != "none":
        kernels = dataclasses.replace(kernels, quant_matmul=quant_kernels(CPU))
    model = Model(
        config,
        load_weights(model_dir, dtype, on_use=shard.world_size > 1),  # as runtime reads
        max_positions=config.context_limit,
        dtype=dtype,
        device=CPU,
        kernels=kernels,
        quantization=quantization,
        shard=shard,
    )
    # The rank's KV cache, from its view of the config: its KV heads only.
    cache = kv_cache.allocate(model.config, NUM_BLOCKS, BLOCK_SIZE, dtype, CPU)
    worker = WorkerConfig(model_dir=str(model_dir), max_num_seqs=8, use_cuda_graphs=False)
    return runtime.runner_on(model, cache, worker)


def run_ranks(work: Callable[..., Any], args: tuple, world: int, workdir: Path) -> Any:
    """Rank 0's `work(shard, *args)` of `world` spawned ranks, which are killed if they
    overrun. `work` is a module-level function: spawn pickles it by name."""
    out = workdir / "rank0.pt"
    spawned = (work, args, world, str(workdir / "rendezvous"), str(out))
    ranks = mp.start_processes(
        _rank_main, args=spawned, nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    while not ranks.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {RANKS_TIMEOUT_S} s")
    return torch.load(out)


def _rank_main(
    rank: int, work: Callable[..., Any], args: tuple, world: int, rendezvous: str, out: str
) -> None:
    """One spawned rank: `work`'s result, which rank 0 saves to `out`."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        result = work(Shard.of(), *args)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(result, out)
