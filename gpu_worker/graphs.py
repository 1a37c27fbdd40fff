"""Decode-only steps, padded to batch-size buckets; captured as CUDA graphs on CUDA.

A decode-only step (every sequence adds one token) is padded up to the next bucket of
`batch_buckets`. Padded rows read and write only the worker's scratch block with context
length 1, so they never touch a real sequence's KV.

On CUDA (with use_cuda_graphs) each (batch bucket, block-table width bucket) is captured
once into a graph whose inputs are static tensors; a step copies its inputs into them and
replays. Elsewhere the same padding runs eagerly, at the exact table width (no capture
needs a fixed one), which keeps the padding logic exercised by the CPU tests.
"""

from __future__ import annotations

import torch

from gpu_worker.attention import AttentionMetadata
from gpu_worker.kv_cache import KVCache
from gpu_worker.model import Model
from gpu_worker.sampler import Logits

_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, ... ending at max_num_seqs."""
    buckets = [b for b in _SMALL_BUCKETS if b < max_num_seqs]
    size = _SMALL_BUCKETS[-1]
    while True:
        is_power_of_two = size & (size - 1) == 0
        size = size * 3 // 2 if is_power_of_two else size * 4 // 3
        if size >= max_num_seqs:
            return [*buckets, max_num_seqs]
        buckets.append(size)


def width_buckets(max_width: int) -> list[int]:
    """Powers of two below max_width, then max_width itself."""
    widths = []
    width = 1
    while width < max_width:
        widths.append(width)
        width *= 2
    return [*widths, max_width]


def smallest_fitting(n: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def decode_forward(
    model: Model,
    cache: KVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> Logits:
    """One decode token per row -> logits [rows, vocab]; tensor ops only."""
    backend = model.kernels.attention
    group = backend.decode_group(
        slice(None), block_tables, context_lens, cache.like, model.config.group_size
    )
    meta = AttentionMetadata(slots, group, [], input_ids.shape[0], backend)
    return model.logits(model.forward(input_ids, positions, cache.layers, meta))


class DecodeRunner:
    def __init__(
        self,
        model: Model,
        cache: KVCache,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        use_cuda_graphs: bool,
    ) -> None:
        self.model = model
        self.cache = cache
        self.buckets = batch_buckets(max_num_seqs)
        self.widths = width_buckets(max_blocks_per_seq)
        self.capture = use_cuda_graphs and model.device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def run(
        self, input_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> Logits:
        """Logits [len(input_ids), vocab] of one decode token per sequence."""
        bs = self.cache.block_size
        rows = len(input_ids)
        needed = max(p // bs + 1 for p in positions)
        batch = smallest_fitting(rows, self.buckets) or rows
        width = (smallest_fitting(needed, self.widths) or needed) if self.capture else needed
        inputs = self._padded_inputs(input_ids, positions, block_tables, batch, width)
        if self.capture and batch in self.buckets:
            logits = self._graph(batch, width).replay(*inputs)
        else:
            logits = decode_forward(self.model, self.cache, *inputs)
        return logits.select(slice(0, rows))

    def _padded_inputs(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        batch: int,
        width: int,
    ) -> tuple[torch.Tensor, ...]:
        bs, scratch = self.cache.block_size, self.cache.scratch_block
        pad = batch - len(input_ids)
        tables = [t[:width] + [scratch] * (width - len(t[:width])) for t in block_tables]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions, strict=True)]
        host = (
            input_ids + [0] * pad,
            positions + [0] * pad,
            slots + [scratch * bs] * pad,
            tables + [[scratch] * width] * pad,
            [p + 1 for p in positions] + [1] * pad,
        )
        device = self.model.device
        return tuple(torch.tensor(values, dtype=torch.long, device=device) for values in host)

    def _graph(self, batch: int, width: int) -> _DecodeGraph:
        key = (batch, width)
        if key not in self._graphs:
            self._graphs[key] = _DecodeGraph(self.model, self.cache, batch, width, self._pool)
        return self._graphs[key]


class _DecodeGraph:
    """One captured decode step of a fixed (batch, width), replayed on static input tensors."""

    def __init__(self, model: Model, cache: KVCache, batch: int, width: int, pool: tuple) -> None:
        device = model.device
        scratch = cache.scratch_block

        def filled(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.long, device=device)

        # Filled as padding rows, so the warm-up runs touch only the scratch block.
        self.inputs = (
            filled((batch,), 0),
            filled((batch,), 0),
            filled((batch,), scratch * cache.block_size),
            filled((batch, width), scratch),
            filled((batch,), 1),
        )
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                decode_forward(model, cache, *self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = decode_forward(model, cache, *self.inputs)

    def replay(self, *inputs: torch.Tensor) -> Logits:
        for static, value in zip(self.inputs, inputs, strict=True):
            static.copy_(value)
        self.graph.replay()
        return self.logits
