"""The C++ kernels (gpu_worker.native) as attention backends, row invariant by construction.

NativeAttention: decode rows and prefill chunks each walk their block tables and read
each K/V byte once; the chunk kernel needs bfloat16 on a CPU with AVX512-BF16.
NativeRowsAttention, where the chunk kernel does not serve: the decode kernel takes a
chunk's rows too, one query each.

The decode kernel takes a sliding window (each row sees its last `window` tokens) and
Gemma 2's soft-capping of the scores, so NativeRowsAttention serves windowed and soft-capped
layers; the chunk kernel takes neither, and NativeAttention is not offered for such models.
Both kernels take attention sinks (gpt-oss: a float32 logit per query head in each row's
softmax), by the same arithmetic, so a row keeps its bits with them too.

A query row gets the same bits whatever else is in the step and whether it is a decode
row or a row of a prefill chunk, so recompute after a preemption reproduces the tokens
decoded before it, in bfloat16 too. An 8-bit cache's rows are dequantized once per task
inside the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker import native
from gpu_worker.attention.base import AttentionBackend, DecodeGroup, LayerAttention, PrefillChunk
from gpu_worker.kv_cache import LayerKV


class NativeAttention(AttentionBackend):
    name = "native"
    row_invariant = True
    windows = False  # the chunk kernel has none
    sinks = True

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    @staticmethod
    def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """bfloat16, on a CPU where the chunk kernel is registered (AVX512-BF16)."""
        kernels = native.kernels() if device.type == "cpu" else None
        return (
            dtype == torch.bfloat16
            and head_dim % 32 == 0
            and head_dim <= 256
            and hasattr(kernels, "paged_prefill_attention")
        )

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        return self._decode_rows(q, kv, group.block_tables, group.context_lens, group.layer)

    def decode_sinks(
        self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup, sinks: torch.Tensor
    ) -> torch.Tensor:
        tables, lens = group.block_tables, group.context_lens
        return self._decode_rows(q, kv, tables, lens, group.layer, sinks)

    def _decode_rows(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        tables: torch.Tensor,
        lens: torch.Tensor,
        layer: LayerAttention,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Query row i over the first lens[i] tokens of block table tables[i] (the last
        `layer.window` of them in a windowed layer), with the layer's `sinks` if any."""
        scale = layer.scale_for(q.shape[-1])
        window, softcap = layer.window or 0, layer.softcap or 0.0
        return self.kernels.paged_decode_attention(
            q,
            kv.k,
            kv.v,
            tables,
            lens,
            scale,
            kv.k_scales,
            kv.v_scales,
            window,
            softcap,
            _float_sinks(sinks),
        )

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        return self._prefill_rows(q, kv, chunk)

    def prefill_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        chunk: PrefillChunk,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        return self._prefill_rows(q, kv, chunk, sinks)

    def _prefill_rows(
        self, q: torch.Tensor, kv: LayerKV, chunk: PrefillChunk, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The chunk's queries through the chunk kernel (their own K/V already cached)."""
        scale = chunk.layer.scale_for(q.shape[-1])
        return self.kernels.paged_prefill_attention(
            q,
            kv.k,
            kv.v,
            chunk.block_table,
            chunk.start,
            scale,
            kv.k_scales,
            kv.v_scales,
            _float_sinks(sinks),
        )


def _float_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels take sinks as float32 (a model's are of its dtype; gpt-oss's bfloat16
    values are exact in float32, so the softmax sees the same logits as PyTorch's)."""
    return None if sinks is None else sinks.float().contiguous()


@dataclass(slots=True)
class RowsChunk:
    """A chunk's rows as decode rows: each one's block table [n, blocks], context length [n]."""

    tables: torch.Tensor
    lens: torch.Tensor


class NativeRowsAttention(NativeAttention):
    name = "native-rows"
    windows = True
    softcap = True

    @staticmethod
    def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Any dtype, on a CPU where the kernels build."""
        return device.type == "cpu" and native.kernels() is not None

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        count = chunk.context_len - chunk.start
        lens = torch.arange(chunk.start + 1, chunk.context_len + 1)
        chunk.prepared = RowsChunk(table.expand(count, -1).contiguous(), lens)
        return chunk

    def _prefill_rows(
        self, q: torch.Tensor, kv: LayerKV, chunk: PrefillChunk, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The chunk's queries as decode rows, one each."""
        rows = chunk.prepared
        return self._decode_rows(q, kv, rows.tables, rows.lens, chunk.layer, sinks)
