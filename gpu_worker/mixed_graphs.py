"""Mixed steps (prefill chunks beside decode rows) from CUDA graphs: whole, or piecewise.

A step's tokens are padded to a token bucket (`token_buckets`: steps of 64 tokens to
1,024, then of 128), and each bucket's graphs are captured at start-up, reading and
writing static buffers: the token ids, positions and cache slots, the residual stream and
the final hidden state (every bucket's are the first rows of the largest's). Padding
tokens sit at position 0 and write their K/V into the scratch block only; no real row
reads them. Captured largest first into one memory pool, so that the smaller buckets
reuse the largest's memory.

Whole, as vLLM's FULL mode for mixed batches: where the attention backend attends a whole
step from static records (AttentionBackend.captures_steps: TritonAttention, one launch per
layer for every chunk and one for the decode rows), a bucket's forward pass is one graph.
A step copies its inputs in, writes its records (gpu_worker.static_records), replays.

Piecewise, for the other backends: a step's attention is then computed from records built
on the host each step, so only what lies between two attentions is captured:
    embedded + before_attention(0), after_attention(i - 1) + before_attention(i), ...,
    after_attention(L - 1)
(gpu_worker.model), through the layer's qkv and attention output buffers. A step replays
piece 0, attends eagerly over the real rows, copies the output in, replays piece 1, and so
on: the launches of everything but attention come from graphs, as in vLLM's piecewise
CUDA graphs.

On CUDA with graphs on, for a model whose steps read no value on the host (not a mixture
of experts) in a single-rank worker. Elsewhere `forward` is the model's own; the capture
bookkeeping runs on a CPU with a fake PieceCapturer in the tests, the whole step's through
Triton's interpreter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpu_worker.attention import AttentionMetadata
from gpu_worker.buckets import smallest_fitting
from gpu_worker.faults import is_device_fault
from gpu_worker.kv_cache import KVCache
from gpu_worker.model import Model
from gpu_worker.static_records import StaticRecords
from gpu_worker.step_inputs import StepInputs, padded_rows

log = logging.getLogger(__name__)

SMALLEST_BUCKETS = (16, 32)  # then every FINE_STEP tokens to FINE_UP_TO, then COARSE_STEP
FINE_STEP = 64
FINE_UP_TO = 1024
COARSE_STEP = 128


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, then multiples of 64 to 1,024 and of 128 beyond, below max_tokens, then
    max_tokens itself: a step pays for at most 63 padded tokens up to 1,024 and 127 beyond
    (a 512-token chunk beside 64 decode rows runs at 576, not 1,024), as vLLM's capture
    sizes step finely. Every bucket past 256 tokens is whole calls of linear's row sizes
    (256s and one of 64, 128 or 192), so its matmuls read the weights no more often."""
    sizes = [
        *SMALLEST_BUCKETS,
        *range(FINE_STEP, FINE_UP_TO + 1, FINE_STEP),
        *range(FINE_UP_TO + COARSE_STEP, max_tokens, COARSE_STEP),
    ]
    return [*(size for size in sizes if size < max_tokens), max_tokens]


class Replayable(Protocol):
    def replay(self) -> None: ...


class PieceCapturer(Protocol):
    """Captures a function of static buffers: CUDA graphs, or a fake in tests."""

    def new_pool(self) -> Any: ...

    def capture(self, piece: Callable[[], None], pool: Any) -> Replayable: ...


@dataclass(slots=True)
class _Buffers:
    """One bucket's static tensors: every graph reads and writes these only."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [KV groups, T]
    x: torch.Tensor  # [T, hidden], the residual stream
    qkv: torch.Tensor  # [T, qkv width] (piecewise)
    attn: torch.Tensor  # [T, heads * head_dim] (piecewise)
    hidden: torch.Tensor  # [T, hidden], the last graph's output


Metadata = Callable[[StepInputs], list[AttentionMetadata]]


class MixedGraphs:
    def __init__(
        self,
        model: Model,
        cache: KVCache,
        max_tokens: int,
        capturer: PieceCapturer | None = None,
        records: StaticRecords | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.buckets = token_buckets(max_tokens)
        self.capturer = capturer
        self.records = records  # a whole step's attention records: captured whole
        self._buffers: dict[int, _Buffers] = {}
        self._largest: _Buffers | None = None  # every bucket's buffers are views of these
        self._graphs: dict[int, list[Replayable]] = {}  # one whole, or the pieces
        self.failed: list[int] = []  # buckets that failed to capture: eager

    @property
    def whole(self) -> bool:
        return self.records is not None

    @torch.inference_mode()
    def capture_all(self) -> dict[str, Any]:
        """Captures every bucket, largest first, into one pool; the handshake's report."""
        started = time.perf_counter()
        if self.capturer is not None:
            pool = self.capturer.new_pool()
            for tokens in reversed(self.buckets):
                self._capture(self.capturer, tokens, pool)
        return {
            "buckets": sorted(self._graphs),
            "failed": self.failed,
            "whole": self.whole and self.capturer is not None,
            "seconds": round(time.perf_counter() - started, 3),
        }

    def forward(
        self,
        inputs: StepInputs,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Metadata,
    ) -> torch.Tensor:
        """The model's forward pass over a mixed step (`metadata`: its attention records,
        built where a step runs eagerly or piecewise). The result is valid until the next
        step."""
        model, tokens = self.model, input_ids.shape[0]
        bucket = smallest_fitting(tokens, self.buckets) or 0
        graphs = self._graphs.get(bucket)
        if graphs is None or inputs.decode_only:
            return model.forward(input_ids, positions, self.cache.layers, metadata(inputs))
        buffers = self._buffers[bucket]
        self._fill(buffers, input_ids, positions, inputs.slots)
        if self.records is not None:
            self.records.fill(inputs, bucket)
            graphs[0].replay()
            return buffers.hidden[:tokens]
        metas = metadata(inputs)
        for index, (layer, kv) in enumerate(zip(model.layers, self.cache.layers, strict=True)):
            graphs[index].replay()
            buffers.attn[:tokens] = model.attend(buffers.qkv[:tokens], kv, metas[layer.attention])
        graphs[-1].replay()
        return buffers.hidden[:tokens]

    def _fill(
        self,
        buffers: _Buffers,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        cache, rows = self.cache, buffers.input_ids.shape[0]
        padded = padded_rows(
            input_ids, positions, slots, rows, cache.block_size, cache.scratch_block
        )
        for static, value in zip(
            (buffers.input_ids, buffers.positions, buffers.slots), padded, strict=True
        ):
            static.copy_(value)

    def _capture(self, capturer: PieceCapturer, tokens: int, pool: Any) -> None:
        try:
            buffers = self._buffers_for(tokens)
            functions = self._whole(buffers) if self.whole else self._piece_functions(buffers)
            graphs = [capturer.capture(function, pool) for function in functions]
        except Exception as exc:
            if is_device_fault(exc):
                raise
            self.failed.append(tokens)
            log.warning("mixed steps of up to %d tokens run eagerly: %s", tokens, exc)
            return
        self._buffers[tokens] = buffers
        self._graphs[tokens] = graphs

    def _buffers_for(self, tokens: int) -> _Buffers:
        """The first `tokens` rows of the largest bucket's buffers: one step runs at a time,
        so every bucket's graphs can read and write the same memory."""
        if self._largest is None:
            self._largest = self._allocate(self.buckets[-1])
        largest = self._largest
        return _Buffers(
            input_ids=largest.input_ids[:tokens],
            positions=largest.positions[:tokens],
            slots=largest.slots[:, :tokens],
            x=largest.x[:tokens],
            qkv=largest.qkv[:tokens],
            attn=largest.attn[:tokens],
            hidden=largest.hidden[:tokens],
        )

    def _allocate(self, tokens: int) -> _Buffers:
        model, device = self.model, self.model.device
        cfg, dtype = model.config, model.dtype
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        groups = len(model.group_attention)
        scratch_slot = self.cache.scratch_block * self.cache.block_size
        piecewise = 0 if self.whole else tokens  # the whole step needs no layer buffers
        return _Buffers(
            input_ids=torch.zeros(tokens, dtype=torch.long, device=device),
            positions=torch.zeros(tokens, dtype=torch.long, device=device),
            slots=torch.full((groups, tokens), scratch_slot, dtype=torch.long, device=device),
            x=torch.zeros(piecewise, cfg.hidden_size, dtype=dtype, device=device),
            qkv=torch.zeros(
                piecewise, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device
            ),
            attn=torch.zeros(piecewise, heads * head_dim, dtype=dtype, device=device),
            hidden=torch.zeros(tokens, cfg.hidden_size, dtype=dtype, device=device),
        )

    def _whole(self, buffers: _Buffers) -> list[Callable[[], None]]:
        """The bucket's whole forward pass, over its records (padding alone until a step
        fills them)."""
        records, model, tokens = self.records, self.model, buffers.input_ids.shape[0]
        assert records is not None
        records.pad(tokens)
        metas = records.metadata(tokens, buffers.slots)

        def whole() -> None:
            hidden = model.forward(buffers.input_ids, buffers.positions, self.cache.layers, metas)
            buffers.hidden.copy_(hidden)

        return [whole]

    def _piece_functions(self, buffers: _Buffers) -> list[Callable[[], None]]:
        """Piece i ends with layer i's qkv (the last piece: the final hidden state)."""
        model, layers, caches = self.model, self.model.layers, self.cache.layers

        def before(index: int, h: torch.Tensor) -> None:
            slots = buffers.slots[layers[index].attention]
            qkv = model.before_attention(index, h, buffers.positions, caches[index], slots)
            buffers.qkv.copy_(qkv)

        def first() -> None:
            x, h = model.embedded(buffers.input_ids)
            buffers.x.copy_(x)
            before(0, h)

        def between(index: int) -> Callable[[], None]:
            def piece() -> None:
                before(index, model.after_attention(index - 1, buffers.x, buffers.attn))

            return piece

        def last() -> None:
            buffers.hidden.copy_(model.after_attention(len(layers) - 1, buffers.x, buffers.attn))

        return [first, *(between(i) for i in range(1, len(layers))), last]


class CudaPieceCapturer:
    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, piece: Callable[[], None], pool: Any) -> Replayable:
        # Twice on a side stream first, as capture requires (lazy initialisation, autotuning).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                piece()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            piece()
        return graph


def static_records(
    model: Model, cache: KVCache, max_tokens: int, max_num_seqs: int, held_width: int
) -> StaticRecords | None:
    """A whole step's records, where the model's attention backend attends from them."""
    backend = model.kernels.attention
    if not backend.captures_steps:
        return None
    return StaticRecords(
        backend,
        model.group_attention,
        held_width,
        max_tokens,
        max_num_seqs,
        cache.like,
        model.config.group_size,
        cache.scratch_block,
    )


def piece_capturer(model: Model, use_cuda_graphs: bool) -> PieceCapturer | None:
    """The capturer where mixed steps are captured: CUDA with graphs on, a model that reads
    no value on the host, one rank (a group's followers run the model eagerly)."""
    capturable = model.capturable and model.shard.world_size == 1
    if not use_cuda_graphs or model.device.type != "cuda" or not capturable:
        return None
    return CudaPieceCapturer()
