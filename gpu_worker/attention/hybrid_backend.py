"""HybridAttention: the C++ decode kernel beside PyTorch's prefill (oneDNN and flash
attention, which use AMX tiles where a CPU has them).

Not row invariant, so the chooser takes it only where no invariant candidate passes its
check; it is measured and reported, and `--kernels attention=hybrid` pins it where long
prompts' TTFT matters more than exact recompute.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.attention.base import AttentionBackend, DecodeGroup, PrefillChunk
from gpu_worker.attention.native_backend import NativeAttention, NativeRowsAttention
from gpu_worker.attention.torch_backend import TorchAttention
from gpu_worker.kv_cache import LayerKV


class HybridAttention(AttentionBackend):
    name = "hybrid"
    row_invariant = False
    paged = False
    windows = True  # both halves serve sliding windows
    softcap = True  # and Gemma 2's soft-capped scores
    sinks = True  # and gpt-oss's attention sinks

    def __init__(self, kernels: Any) -> None:
        self._decoder = NativeAttention(kernels)
        self._prefiller = TorchAttention()

    @staticmethod
    def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        return NativeRowsAttention.serves(device, dtype, head_dim)

    def decode_group(
        self, group: DecodeGroup, cache_like: torch.Tensor, group_size: int
    ) -> DecodeGroup:
        return self._decoder.decode_group(group, cache_like, group_size)

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        return self._prefiller.prefill_chunk(chunk, table, cache_like)

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        return self._decoder.decode(q, kv, group)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        return self._prefiller.prefill(q, k, v, kv, chunk)

    def decode_sinks(
        self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup, sinks: torch.Tensor
    ) -> torch.Tensor:
        return self._decoder.decode_sinks(q, kv, group, sinks)

    def prefill_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        chunk: PrefillChunk,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        return self._prefiller.prefill_sinks(q, k, v, kv, chunk, sinks)
