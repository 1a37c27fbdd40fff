"""Decode-only steps, padded to batch-size buckets; replayed from CUDA graphs on CUDA.

A decode-only step (every sequence adds one token) is padded up to the next bucket of
`batch_buckets`. Padded rows read and write only the worker's scratch block with context
length 1, so they never touch a real sequence's KV.

On CUDA (with use_cuda_graphs) every (batch bucket, block-table width) shape is captured
at start-up, before the worker answers its handshake: a capture costs a sync and an
allocator flush, which during serving would show as latency spikes. A step's host work
before a replay is one copy of its staged integers into the graph's static input
(gpu_worker.staging) and one gather of its rows' tables from the worker's; the slots and
contexts are derived inside the graph. Steps, captures and warm-ups run under
torch.inference_mode (no autograd bookkeeping in eager ops). Capture goes largest batch first into
one memory pool, so the smaller graphs reuse the memory of the largest. A shape that fails
to capture is logged once and served eagerly from then on; it is never retried.

Widths are bounded: powers of two up to GRAPH_CONTEXT_TOKENS of context (`graph_widths`).
A graph removes the CPU cost of launching a step's kernels, which matters while a step is
short; at longer contexts the step reads so much KV that the launches hide behind it, so
wider tables run eagerly rather than multiplying the graphs (and start-up time) by up to
14 widths for a 128k-token model.

A backend whose cost does not grow with the tables' width (AttentionBackend.any_width:
FlexAttention walks each row's block list, as long as its context) is given every table
at the longest width instead: one graph per batch bucket covers every context, so no
decode step runs eagerly however long its context, and start-up captures a few graphs
rather than buckets x widths.

Elsewhere the same padding runs eagerly, at the exact table width (no capture needs a
fixed one), which keeps the padding logic exercised by the CPU tests; the capture
bookkeeping runs there too with a fake GraphCapturer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpu_worker.attention import AttentionMetadata, decode_records
from gpu_worker.buckets import batch_buckets, smallest_fitting
from gpu_worker.faults import is_device_fault
from gpu_worker.kv_cache import KVCache
from gpu_worker.model import Model
from gpu_worker.sampler import Logits
from gpu_worker.seq_table import PAD_SLOT
from gpu_worker.staging import STAGED, DecodeStaging, gather_tables
from gpu_worker.step_inputs import StepInputs

log = logging.getLogger(__name__)

GRAPH_CONTEXT_TOKENS = 8192  # the longest context a captured graph covers


def width_buckets(max_width: int) -> list[int]:
    """Powers of two below max_width, then max_width itself."""
    widths = []
    width = 1
    while width < max_width:
        widths.append(width)
        width *= 2
    return [*widths, max_width]


def graph_widths(
    max_width: int, block_size: int, max_tokens: int = GRAPH_CONTEXT_TOKENS
) -> list[int]:
    """The block-table widths captured: width_buckets up to max_tokens of context."""
    return width_buckets(min(max_width, -(-max_tokens // block_size)))


@dataclass(slots=True)
class DecodeInputs:
    """A decode step's device inputs: the staged integers [3, B] (input ids, positions,
    table rows: gpu_worker.staging) and the rows' tables [G, B, W]. A captured graph's
    are static: each step is copied into them."""

    ints: torch.Tensor
    tables: torch.Tensor

    @classmethod
    def padding(
        cls, groups: int, batch: int, width: int, scratch: int, device: torch.device
    ) -> DecodeInputs:
        """`batch` padding rows (graph capture): token 0 at position 0, in the PAD_SLOT
        row, whose tables name the scratch block alone."""
        ints = torch.zeros((STAGED, batch), dtype=torch.long, device=device)
        ints[2] = PAD_SLOT
        tables = torch.full((groups, batch, width), scratch, dtype=torch.long, device=device)
        return cls(ints, tables)


def decode_forward(model: Model, cache: KVCache, inputs: DecodeInputs) -> Logits:
    """One decode token per row -> logits [rows, vocab]; tensor ops only, so a graph
    captures every step from the staged integers on: each row's cache slot in each KV
    group, from its tables at its position, and its context."""
    backend, group_size = model.kernels.attention, model.config.group_size
    input_ids, positions = inputs.ints[0], inputs.ints[1]
    slots = decode_slots(inputs.tables, positions, cache.block_size)
    context_lens = positions + 1
    metas = []
    for g, kind in enumerate(model.group_attention):
        group = decode_records(
            slice(None), inputs.tables[g], context_lens, cache.like, group_size, backend, kind
        )
        metas.append(AttentionMetadata(slots[g], group, [], input_ids.shape[0], backend))
    return model.logits(model.forward(input_ids, positions, cache.layers, metas))


def decode_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[G, B] the cache slot of each row's token at `positions` [B], by its tables [G, B, W]."""
    blocks = positions // block_size
    index = blocks.view(1, -1, 1).expand(tables.shape[0], -1, 1)
    return tables.gather(2, index).squeeze(2) * block_size + positions % block_size


class DecodeGraph(Protocol):
    inputs: DecodeInputs  # the static inputs a step is copied into

    def replay(self) -> Logits:
        """The logits of the step in `inputs`, valid until the next replay of any graph
        of the same capturer."""
        ...


class GraphCapturer(Protocol):
    """Captures decode steps of a fixed (batch, width): CudaGraphCapturer, or a fake in tests."""

    def new_pool(self) -> Any: ...

    def capture(self, batch: int, width: int, pool: Any) -> DecodeGraph: ...


class DecodeRunner:
    def __init__(
        self,
        model: Model,
        cache: KVCache,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        capturer: GraphCapturer | None = None,
        graph_context_tokens: int = GRAPH_CONTEXT_TOKENS,
    ) -> None:
        self.model = model
        self.cache = cache
        self.buckets = batch_buckets(max_num_seqs)
        if model.kernels.attention.any_width:
            self.widths = [max_blocks_per_seq]
        else:
            self.widths = graph_widths(max_blocks_per_seq, cache.block_size, graph_context_tokens)
        self.capturer = capturer
        self.staging = DecodeStaging(model.device)
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.failed: list[tuple[int, int]] = []  # shapes that failed to capture: eager

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch, width) shape a graph is captured for, in capture order."""
        return [(b, w) for b in reversed(self.buckets) for w in reversed(self.widths)]

    @torch.inference_mode()
    def capture_all(self) -> dict[str, Any]:
        """Captures every shape, largest first, into one pool; returns the handshake's report."""
        started = time.perf_counter()
        capturer = self.capturer
        if capturer is not None:
            pool = capturer.new_pool()
            for batch, width in self.shapes():
                self._capture(capturer, batch, width, pool)
        return {
            "captured": len(self._graphs),
            "failed": [list(shape) for shape in self.failed],
            "seconds": round(time.perf_counter() - started, 3),
            "widths": self.widths if capturer is not None else [],
        }

    def _capture(self, capturer: GraphCapturer, batch: int, width: int, pool: Any) -> None:
        try:
            self._graphs[(batch, width)] = capturer.capture(batch, width, pool)
        except Exception as exc:
            if is_device_fault(exc):
                raise  # the device is unusable now: eager steps would fail too
            self.failed.append((batch, width))  # any other failure: the eager path
            log.warning("decode graph (batch %d, width %d) runs eagerly: %s", batch, width, exc)

    def shape(self, inputs: StepInputs) -> tuple[int, int]:
        """The (batch, table width) a decode step runs at: the smallest batch bucket and
        captured width that hold it, a graph's; the exact width where none was captured."""
        rows = inputs.num_seqs
        needed = -(-max(inputs.ends(list(range(rows)))) // self.cache.block_size)
        batch = smallest_fitting(rows, self.buckets) or rows
        width = smallest_fitting(needed, self.widths) or needed
        return (batch, width) if (batch, width) in self._graphs else (batch, needed)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> Logits:
        """Logits [rows, vocab] of a decode-only step (one token per sequence)."""
        batch, width = self.shape(inputs)
        graph = self._graphs.get((batch, width))
        staged = self.staging.stage(inputs, batch)
        if graph is None:
            ints = self.staging.send(staged)
            tables = gather_tables(inputs.held_tables, ints[2], width)
            logits = decode_forward(self.model, self.cache, DecodeInputs(ints, tables))
        else:
            static = graph.inputs
            self.staging.send(staged, into=static.ints)
            gather_tables(inputs.held_tables, static.ints[2], width, out=static.tables)
            logits = graph.replay()
        return logits.select(slice(0, inputs.num_seqs))


def graph_capturer(model: Model, cache: KVCache, use_cuda_graphs: bool) -> GraphCapturer | None:
    """The capturer for the model's device; None where graphs are off, not CUDA, or the
    model's steps read values on the host (a mixture of experts, gpu_worker.moe)."""
    if not use_cuda_graphs or model.device.type != "cuda" or not model.capturable:
        return None
    return CudaGraphCapturer(model, cache)


class CudaGraphCapturer:
    """Captures decode steps as CUDA graphs whose logits land in one shared set of buffers
    (rows of the first, largest batch): a graph's own output would stay alive in the pool
    and keep every later graph from reusing that memory."""

    def __init__(self, model: Model, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self._outputs: Logits | None = None

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, batch: int, width: int, pool: Any) -> DecodeGraph:
        model, cache = self.model, self.cache
        # Padding rows only, so the warm-up runs touch only the scratch block.
        groups = len(model.group_attention)
        inputs = DecodeInputs.padding(groups, batch, width, cache.scratch_block, model.device)
        warm = self._warm_up(inputs)
        outputs = self._outputs_for(warm, batch)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = decode_forward(model, cache, inputs)
            written = outputs.fields()
            for name, value in logits.fields().items():
                written[name].copy_(value)
        return _CudaDecodeGraph(graph, inputs, outputs)

    def _warm_up(self, inputs: DecodeInputs) -> Logits:
        """Runs the step twice on a side stream, as capture requires: lazy initialisation
        (cuBLAS handles, kernel autotuning) must not happen inside the graph."""
        device = self.model.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                logits = decode_forward(self.model, self.cache, inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        return logits

    def _outputs_for(self, like: Logits, batch: int) -> Logits:
        if self._outputs is None or self._outputs.num_rows < batch:
            empty = {name: torch.empty_like(t) for name, t in like.fields().items()}
            self._outputs = Logits(**empty)
        return self._outputs.select(slice(0, batch))


class _CudaDecodeGraph:
    """One captured decode step, replayed on its static inputs."""

    def __init__(self, graph: Any, inputs: DecodeInputs, outputs: Logits) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs

    def replay(self) -> Logits:
        self.graph.replay()
        return self.outputs
