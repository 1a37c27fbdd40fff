"""The paged KV cache: per layer, K and V tensors of fixed-size token blocks.

Blocks 0..num_blocks-1 belong to the service, which puts their ids in block tables. One
more block at the end is the worker's scratch block: padded decode rows write there, so
padding never touches a real sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model_config import ModelConfig


class KVCacheError(ValueError):
    """The memory budget cannot hold a usable cache."""


@dataclass(slots=True)
class LayerKV:
    """One layer's cache: K and V [kv_heads, num_blocks + 1, block_size, d]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass(slots=True)
class KVCache:
    layers: list[LayerKV]
    num_blocks: int  # usable by the service
    block_size: int

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def like(self) -> torch.Tensor:
        """Any layer's K cache: it gives the shapes, dtype and device of them all."""
        return self.layers[0].k


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    per_token = config.num_key_value_heads * config.head_dim * dtype.itemsize
    return 2 * config.num_hidden_layers * block_size * per_token


def budget_bytes(kv_memory: float, free_bytes: int) -> int:
    """kv_memory <= 1.0 is a fraction of the free memory; above that, a number of bytes."""
    if kv_memory <= 0:
        raise KVCacheError(f"kv_memory must be positive, got {kv_memory}")
    if kv_memory <= 1.0:
        return int(kv_memory * free_bytes)
    return int(kv_memory)


def count_blocks(
    kv_memory: float, free_bytes: int, bytes_per_block: int, max_useful_blocks: int
) -> int:
    """How many service blocks fit the budget (the scratch block included in it), capped by
    how many could ever be used at once."""
    budget = budget_bytes(kv_memory, free_bytes)
    fitting = budget // bytes_per_block - 1
    if fitting < 1:
        raise KVCacheError(
            f"a KV budget of {budget} bytes holds no block (one block of all layers takes "
            f"{bytes_per_block} bytes, and the worker keeps one scratch block); raise kv_memory"
        )
    return min(fitting, max_useful_blocks)


def allocate(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    # Zeros, not empty: attention masks stale slots out, but a masked NaN would still
    # poison the output (NaN * 0 = NaN).
    shape = (config.num_key_value_heads, num_blocks + 1, block_size, config.head_dim)
    layers = [
        LayerKV(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]
    return KVCache(layers=layers, num_blocks=num_blocks, block_size=block_size)
