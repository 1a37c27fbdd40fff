"""The paged KV cache: per slot, K and V tensors of fixed-size token blocks.

A layer keeps its K/V in a slot (gpu_worker.kv_groups): each its own, or on a hybrid model
the i-th layer of every group of layers in slot i, a block id then naming positions of one
group. Blocks 0..num_blocks-1 belong to the service, which puts their ids in block tables.
One more block at the end is the worker's scratch block: padded decode rows write there,
so padding never touches a real sequence.

The cache holds the model's dtype, or 8-bit codes with a float32 scale per (token, kv
head) row (`--kv-cache-dtype int8|fp8`, gpu_worker.kv_quant): 68 bytes a row of 64 dims
instead of 128, so 1.9x the blocks in the same memory, and fewer bytes for each decode
step to read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass

import torch

from gpu_worker.kv_groups import KVGroups
from gpu_worker.kv_quant import KV_CACHE_DTYPES, dequantize
from gpu_worker.model_config import ModelConfig


class KVCacheError(ValueError):
    """The memory budget cannot hold a usable cache."""


@dataclass(slots=True)
class LayerKV:
    """One slot's cache: K and V [kv_heads, num_blocks + 1, block_size, d], and for an
    8-bit cache their scales [kv_heads, num_blocks + 1, block_size]."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None

    def values(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as attention sees them: of the model's `dtype`, dequantized if 8-bit."""
        if self.k_scales is None or self.v_scales is None:
            return self.k, self.v
        return dequantize(self.k, self.k_scales, dtype), dequantize(self.v, self.v_scales, dtype)

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.k, self.v, self.k_scales, self.v_scales

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not None)


@dataclass(slots=True)
class KVCache:
    slots: list[LayerKV]
    layers: list[LayerKV]  # each layer's slot
    num_blocks: int  # usable by the service
    block_size: int

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def bytes(self) -> int:
        return sum(slot.bytes for slot in self.slots)

    @property
    def like(self) -> torch.Tensor:
        """Any slot's K cache: it gives the shapes, dtype and device of them all."""
        return self.slots[0].k


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype -> the cache tensors' dtype: "auto" is the model's."""
    if name == "auto" or name == str(model_dtype).removeprefix("torch."):
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise KVCacheError(
            f"kv_cache_dtype must be auto, {', '.join(KV_CACHE_DTYPES)} or the model's dtype "
            f"({str(model_dtype).removeprefix('torch.')}), got {name!r}"
        )
    return KV_CACHE_DTYPES[name]


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all slots, K and V (and their scales when 8-bit)."""
    row = config.head_dim * dtype.itemsize
    if dtype in KV_CACHE_DTYPES.values():
        row += torch.float32.itemsize
    slots = KVGroups.of(config).num_slots
    return 2 * slots * block_size * config.num_key_value_heads * row


def budget_bytes(kv_memory: float, free_bytes: int, reserved_bytes: int = 0) -> int:
    """kv_memory <= 1.0 is a fraction of the free memory left once `reserved_bytes` (the
    activations a profiling step measured) are set aside; above 1.0, a number of bytes.

    vLLM's gpu_memory_utilization is instead a fraction of the device's TOTAL memory, from
    which it subtracts what the weights, the profiled activations and everything else on
    the device use. cadence keeps --kv-memory a fraction of what is free after the weights
    (so its meaning on a CPU and on a GPU is the same), and takes the activations out
    before applying it: with 0.9, a tenth of what is left stays free for fragmentation and
    allocations no profile sees.
    """
    if kv_memory <= 0:
        raise KVCacheError(f"kv_memory must be positive, got {kv_memory}")
    if kv_memory > 1.0:
        return int(kv_memory)
    if reserved_bytes >= free_bytes:
        raise KVCacheError(
            f"the largest step needs {reserved_bytes} bytes of activations but only "
            f"{free_bytes} are free after loading; lower max_num_batched_tokens or max_num_seqs"
        )
    return int(kv_memory * (free_bytes - reserved_bytes))


def activation_reserve(mixed_peak: int, decode_peak: int, graphs: bool) -> int:
    """Bytes to keep free beside the KV cache: the peak of the largest mixed step, and of
    the largest decode step. Captured graphs keep their memory in their own pool, which
    eager steps cannot use: the decode steps' and the mixed steps' (gpu_worker.mixed_graphs:
    whole, or pieces beside a mixed step's eager attention), beside the eager steps of a
    bucket that failed to capture, so with graphs the mixed peak counts twice, and the
    three add up."""
    return 2 * mixed_peak + decode_peak if graphs else max(mixed_peak, decode_peak)


def count_blocks(
    kv_memory: float,
    free_bytes: int,
    bytes_per_block: int,
    max_useful_blocks: int,
    reserved_bytes: int = 0,
) -> int:
    """How many service blocks fit the budget (the scratch block included in it), capped by
    how many could ever be used at once."""
    budget = budget_bytes(kv_memory, free_bytes, reserved_bytes)
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
    rows = (config.num_key_value_heads, num_blocks + 1, block_size)

    def zeros(shape: tuple[int, ...], of: torch.dtype) -> torch.Tensor:
        if device.type != "cpu":
            return torch.zeros(shape, dtype=of, device=device)
        return _on_small_pages(torch.empty(shape, dtype=of)).zero_()

    quantized = dtype in KV_CACHE_DTYPES.values()
    groups = KVGroups.of(config)
    slots = [
        LayerKV(
            zeros((*rows, config.head_dim), dtype),
            zeros((*rows, config.head_dim), dtype),
            zeros(rows, torch.float32) if quantized else None,
            zeros(rows, torch.float32) if quantized else None,
        )
        for _ in range(groups.num_slots)
    ]
    layers = [slots[groups.slot_of(i)] for i in range(config.num_hidden_layers)]
    return KVCache(slots=slots, layers=layers, num_blocks=num_blocks, block_size=block_size)


# The worker's malloc hands large blocks 2 MiB pages (worker_link's glibc tunable), which the
# weights want: a decode step streams them all. For the cache they are start-up time: with
# transparent huge pages on "madvise" the kernel compacts memory for each huge page on its
# first touch, 1.07 s a GiB against 0.27 s with 4 KiB pages on a Zen 4 VM, and the default
# cache is several GiB (BENCHMARKS.md section 15). So the cache asks for small pages before
# it is zeroed.
_MADV_NOHUGEPAGE = 15
_PAGE = 4096


def _on_small_pages(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, its pages not yet touched, marked for 4 KiB pages (best effort)."""
    start = -(-tensor.data_ptr() // _PAGE) * _PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // _PAGE * _PAGE
    if end > start and (libc := _libc()) is not None:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_NOHUGEPAGE)
    return tensor


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # not glibc or musl: no madvise to ask
        return None
