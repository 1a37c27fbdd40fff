"""Choosing the worker's kernels by measuring them on this machine.

The kernel that wins on one CPU loses on another: oneDNN's bfloat16 matmuls use AMX tiles
where a CPU has them and a hand-written AVX-512 loop does not; without AVX-512 the C++
kernels fall back to scalar loops. So at worker start every candidate of each seam
(gpu_worker.kernels) runs on the model's own shapes, is checked against the PyTorch
reference, and is timed; the fastest that passes is used. The layer ops are timed as
serving runs them, on inputs built beforehand, and on CUDA captured into a CUDA graph, as
a step replays them, and timed by CUDA events: called eagerly, their time would be mostly
the launches' and Inductor's guards', which a replay never pays.

Attention has one more check. A candidate that claims row invariance is held to it, bit
for bit: a decode row alone and among others, and a prefill row against the same token
decoded. Where such a candidate passes, only those serve, however much faster another is:
recompute after a preemption must reproduce the tokens decoded before it, and a row's
tokens must not depend on its batch (tests/test_worker_batch_invariance.py shows it on the
real model). Where none is offered (CUDA), candidates that read the cache in place (paged,
as FlexAttention) win over the gathering reference, whose copy of the context is memory
the KV budget does not count. A model with attention sinks (gpt-oss) has its candidates
checked with sinks (`decode_sinks`, `prefill_sinks`), row invariance included.

The choice is cached in a JSON file (the service passes <cache dir>/kernels.json), one
entry per CPU model and ISA flags, torch version, kernel sources, device, dtype, model
shapes, block size and pins, so that only a worker's first start on a machine pays for the
measuring (about a second for the default model). The same file keeps, per machine, the
matmul call sizes gpu_worker.linear checked on each weight shape (`recall`, `record`):
checking them is most of a first start. An operator may pin a seam to one candidate
(`--kernels attention=torch`); a pinned candidate is still checked.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from gpu_worker import kernels as kernel_set
from gpu_worker import native
from gpu_worker.attention import (
    FULL,
    AttentionBackend,
    DecodeGroup,
    LayerAttention,
    metadata_for,
)
from gpu_worker.kernels import Kernels
from gpu_worker.kv_cache import LayerKV
from gpu_worker.kv_quant import quantize_rows
from gpu_worker.layer_ops import LayerOps, write_kv
from gpu_worker.linear import Linear
from gpu_worker.mixed_graphs import CudaPieceCapturer, PieceCapturer
from gpu_worker.model import attention_kinds
from gpu_worker.model_config import ModelConfig, Rope
from gpu_worker.rope import rope_tables

C = TypeVar("C")
REPEATS = 5  # timed rounds, after one warm-up; each candidate's fastest round counts
# Agreement with the reference: the PyTorch and C++ paths sum in other orders.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
CHECK_WINDOW = 100  # the longest window attention candidates are checked with


@dataclass(frozen=True, slots=True)
class Shapes:
    """What the candidates are measured on: the model's shapes, dtype and device."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    cache_dtype: torch.dtype  # the model's dtype, or an 8-bit one (gpu_worker.kv_quant)
    # The model's kinds of attention layer: which backends serve it (windows, soft-capping).
    layers: tuple[LayerAttention, ...] = (FULL,)

    @classmethod
    def of(
        cls,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        cache_dtype: torch.dtype,
    ) -> Shapes:
        return cls(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
            config.intermediate_size,
            block_size,
            dtype,
            device,
            cache_dtype,
            tuple(attention_kinds(config)),
        )

    def checked_layer(self) -> LayerAttention:
        """The model's kind of attention layer that candidates are checked on: a windowed
        one where there is one, its window cut so that it bites in the checked contexts."""
        windowed = [layer for layer in self.layers if layer.window is not None]
        if not windowed:
            return self.layers[-1]
        return dataclasses.replace(windowed[0], window=min(windowed[0].window or 0, CHECK_WINDOW))

    def cache(self, num_blocks: int, generator: torch.Generator) -> LayerKV:
        """A layer's cache of `num_blocks` blocks holding random rows."""
        shape = (self.kv_heads, num_blocks, self.block_size, self.head_dim)
        k, v = (torch.randn(shape, generator=generator).to(self.dtype) for _ in "kv")
        if self.cache_dtype == self.dtype:
            return LayerKV(k.to(self.device), v.to(self.device))
        (k, k_scales), (v, v_scales) = (quantize_rows(x, self.cache_dtype) for x in (k, v))
        return LayerKV(*(t.to(self.device) for t in (k, v, k_scales, v_scales)))


@dataclass(slots=True)
class Trial:
    name: str
    ms: float | None  # best time of the seam's workload; None when it failed its check
    failed: str = ""  # why it failed


@dataclass(slots=True)
class Choice:
    kernels: Kernels
    trials: dict[str, list[Trial]] = field(default_factory=dict)
    cached: bool = False

    def report(self) -> dict[str, Any]:
        """The chosen names and every candidate's time (or failure), for the handshake."""
        measured = {
            seam: {t.name: t.ms if t.ms is not None else f"failed: {t.failed}" for t in trials}
            for seam, trials in self.trials.items()
        }
        return {**self.kernels.names(), "measured": measured, "cached": self.cached}


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for `device`'s queued work: torch.cuda.synchronize on a GPU; nothing on
    a CPU, whose kernels have finished when they return."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


Timer = Callable[[Callable[[], object]], float]  # runs a call -> the seconds it took


def wall_timer(clock: Callable[[], float], sync: Callable[[], None]) -> Timer:
    """`clock` around the call, the device waited for before and after (`sync`)."""

    def timed(call: Callable[[], object]) -> float:
        sync()
        started = clock()
        call()
        sync()
        return clock() - started

    return timed


def device_timer(device: torch.device) -> Timer:
    """On CUDA, events recorded around the call on the current stream: the device's own
    time for the work the call queues, not the host's around it; elsewhere the wall clock,
    the work done when the call returns."""
    if device.type != "cuda":
        return wall_timer(time.perf_counter, lambda: None)

    def timed(call: Callable[[], object]) -> float:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    return timed


class NoCorrectKernel(RuntimeError):
    """Every candidate of a seam failed its check."""


def _trial(name: str, failed: str | None, times: list[float]) -> Trial:
    """A candidate's failure, or its fastest round in ms."""
    if failed is not None:
        return Trial(name, None, failed)
    return Trial(name, round(min(times) * 1000, 3))


def pick(
    candidates: Sequence[C],
    name: Callable[[C], str],
    check: Callable[[C], str | None],
    workload: Callable[[C], object],
    preferred: Callable[[C], bool] = lambda candidate: True,
    timer: Timer | None = None,
) -> tuple[C, list[Trial]]:
    """The fastest preferred candidate whose check passes (returns None); the fastest
    passing one only when no preferred one passes.

    `timer` times one run: by default the wall clock (wall_timer); a GPU's kernels run
    after their launch returns, so there it must wait for the device (device_sync in
    wall_timer, or device_timer's events): without that a timing reads the launches alone,
    and the previous candidate's queued work lands in the next one's time.

    Candidates are timed in turns, one run each per round, so that a change in the
    machine's load (a neighbour on a shared host) weighs on all of them alike; each gets
    its fastest of REPEATS rounds, after a warm-up run: a busy neighbour only ever adds
    time, and on a shared 2-vCPU host a median of five still flipped a choice in CI.
    """
    failures = {id(c): check(c) for c in candidates}
    passing = [c for c in candidates if failures[id(c)] is None]
    times: dict[int, list[float]] = {id(c): [] for c in passing}
    for candidate in passing:
        workload(candidate)  # first-call allocations and lazy initialisation
    timed = timer or wall_timer(time.perf_counter, lambda: None)
    for _ in range(REPEATS):
        for candidate in passing:
            times[id(candidate)].append(timed(functools.partial(workload, candidate)))
    trials = [_trial(name(c), failures[id(c)], times.get(id(c), [])) for c in candidates]
    if not passing:
        raise NoCorrectKernel("; ".join(f"{t.name}: {t.failed}" for t in trials))
    # Ties go to the earlier candidate: min keeps the first of equals.
    best_time = {id(c): min(times[id(c)]) for c in passing}
    favoured = [c for c in passing if preferred(c)] or passing
    best = min(favoured, key=lambda c: best_time[id(c)])
    return best, trials


def choose(shapes: Shapes, pins: dict[str, str], cache_file: Path | None) -> Choice:
    """The kernels for these shapes: from the cache file, or measured now and recorded
    there (no file: measured every time)."""
    key = _cache_key(shapes, pins)
    recorded = None if cache_file is None else _read_cache(cache_file).get(key)
    if recorded is not None:
        try:
            chosen = named(shapes, recorded["names"])
        except KeyError:  # a kernel no longer offered here: measure again
            pass
        else:
            trials = {
                seam: [Trial(**t) for t in seam_trials]
                for seam, seam_trials in recorded["trials"].items()
            }
            return Choice(chosen, trials, cached=True)
    choice = measure_all(shapes, pins)
    if cache_file is not None:
        _write_cache(cache_file, key, choice)
    return choice


def named(shapes: Shapes, names: dict[str, str]) -> Kernels:
    """The kernels `names` names (a recorded choice, or rank 0's of a tensor-parallel
    group) for these shapes; KeyError where one is not offered here."""
    return kernel_set.by_names(names, shapes.device, shapes.dtype, shapes.head_dim, shapes.layers)


def measure_all(shapes: Shapes, pins: dict[str, str]) -> Choice:
    offered = kernel_set.candidates(shapes.device, shapes.dtype, shapes.head_dim, shapes.layers)
    for seam, name in pins.items():
        offered[seam] = [c for c in offered[seam] if kernel_set.name_of(c) == name]
        if not offered[seam]:
            raise NoCorrectKernel(f"the pinned {seam} kernel {name!r} is not offered here")
    attention, attention_trials = choose_attention(offered["attention"], shapes)
    layer_ops, layer_ops_trials = choose_layer_ops(offered["layer_ops"], shapes)
    matmul, matmul_trials = choose_matmul(offered["matmul"], shapes)
    trials = {"attention": attention_trials, "layer_ops": layer_ops_trials, "matmul": matmul_trials}
    return Choice(Kernels(attention, layer_ops, matmul), trials)


# ---- attention ------------------------------------------------------------------------


@dataclass(slots=True)
class AttentionCase:
    """A decode batch and a prefill chunk on a paged cache of the model's shapes.

    Block tables are shuffled, contexts differ between sequences, and the chunk starts
    mid-sequence, so a candidate meets what a serving step gives it.
    """

    kv: LayerKV
    q_decode: torch.Tensor  # [B, heads, d]
    tables: torch.Tensor  # [B, W] on the host
    lens: list[int]
    q_chunk: torch.Tensor  # [n, heads, d]
    k_chunk: torch.Tensor  # [n, kv_heads, d]
    v_chunk: torch.Tensor
    chunk_start: int
    chunk_table: torch.Tensor  # [W]
    group_size: int
    layer: LayerAttention = FULL  # how the case's layer attends (Shapes.checked_layer)
    sinks: torch.Tensor | None = None  # [heads]: the layer's attention sinks, where it has them


def attention_case(
    shapes: Shapes, batch: int = 16, chunk: int = 256, start: int = 512
) -> AttentionCase:
    generator = torch.Generator().manual_seed(0)
    bs, d, kv_heads = shapes.block_size, shapes.head_dim, shapes.kv_heads
    lens = torch.randint(max(1, start - 128), start + 128, (batch,), generator=generator).tolist()
    width = -(-max(max(lens), start + chunk) // bs)
    num_blocks = (batch + 1) * width
    order = torch.randperm(num_blocks, generator=generator)
    tables, chunk_table = order[: batch * width].view(batch, width), order[batch * width :]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(shapes.device, shapes.dtype)

    kv = shapes.cache(num_blocks, generator)
    k_chunk, v_chunk = randn(chunk, kv_heads, d), randn(chunk, kv_heads, d)
    positions = torch.arange(start, start + chunk)
    slots = (chunk_table[positions // bs] * bs + positions % bs).to(shapes.device)
    write_kv(kv, k_chunk, v_chunk, slots)
    # As the model passes q: a strided view of a wider row.
    q_decode = randn(batch, shapes.heads + kv_heads, d)[:, : shapes.heads]
    q_chunk = randn(chunk, shapes.heads + kv_heads, d)[:, : shapes.heads]
    group_size = shapes.heads // kv_heads
    layer = shapes.checked_layer()
    # Sinks near the log-sum-exp of a few hundred keys: each takes a real share of its row.
    sinks = 6 + 2 * randn(shapes.heads) if layer.sinks else None
    return AttentionCase(
        kv,
        q_decode,
        tables,
        lens,
        q_chunk,
        k_chunk,
        v_chunk,
        start,
        chunk_table,
        group_size,
        layer,
        sinks,
    )


def run_decode(
    backend: AttentionBackend, case: AttentionCase, seqs: Sequence[int] | None = None
) -> torch.Tensor:
    seqs = range(len(case.lens)) if seqs is None else seqs
    lens = [case.lens[s] for s in seqs]
    device = case.kv.k.device
    meta = metadata_for(
        [1] * len(seqs),
        [n - 1 for n in lens],
        case.tables[list(seqs)],
        torch.zeros(len(seqs), dtype=torch.long, device=device),
        case.kv.k,
        case.group_size,
        backend,
        case.layer,
    )
    assert meta.decode is not None  # every row decodes
    return _decode(backend, case, case.q_decode[list(seqs)], meta.decode)


def run_prefill(backend: AttentionBackend, case: AttentionCase) -> torch.Tensor:
    n, device = case.q_chunk.shape[0], case.kv.k.device
    meta = metadata_for(
        [n],
        [case.chunk_start],
        case.chunk_table[None],
        torch.zeros(n, dtype=torch.long, device=device),
        case.kv.k,
        case.group_size,
        backend,
        case.layer,
    )
    chunk, q, k, v = meta.prefills[0], case.q_chunk, case.k_chunk, case.v_chunk
    if case.sinks is not None:
        return backend.prefill_sinks(q, k, v, case.kv, chunk, case.sinks)
    return backend.prefill(q, k, v, case.kv, chunk)


def decode_chunk_rows(
    backend: AttentionBackend, case: AttentionCase, rows: list[int]
) -> torch.Tensor:
    """The chunk's `rows` as decode tokens, each over its own context."""
    start, device = case.chunk_start, case.kv.k.device
    meta = metadata_for(
        [1] * len(rows),
        [start + r for r in rows],
        case.chunk_table.expand(len(rows), -1),
        torch.zeros(len(rows), dtype=torch.long, device=device),
        case.kv.k,
        case.group_size,
        backend,
        case.layer,
    )
    assert meta.decode is not None  # every row decodes
    return _decode(backend, case, case.q_chunk[rows], meta.decode)


def _decode(
    backend: AttentionBackend, case: AttentionCase, q: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    """Decode rows q of the case's layer, with its sinks where it has them."""
    if case.sinks is not None:
        return backend.decode_sinks(q, case.kv, group, case.sinks)
    return backend.decode(q, case.kv, group)


def check_attention(
    backend: AttentionBackend,
    case: AttentionCase,
    expected: tuple[torch.Tensor, torch.Tensor],
    other_shapes: Sequence[AttentionCase] = (),
) -> str | None:
    """None when the backend agrees with the reference (and keeps its rows invariant, if
    it claims to, on `case` and on each of `other_shapes`); else what is wrong."""
    tolerance = TOLERANCE[case.q_decode.dtype]
    try:
        decoded, prefilled = run_decode(backend, case), run_prefill(backend, case)
        for what, got, want in (
            ("decode", decoded, expected[0]),
            ("prefill", prefilled, expected[1]),
        ):
            if not torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance):
                error = (got.float() - want.float()).abs().max().item()
                return f"{what} differs from the reference by up to {error:.3g}"
        if backend.row_invariant:
            failure = _row_invariance_failure(backend, case, decoded, prefilled)
            for other in other_shapes:
                decoded, prefilled = run_decode(backend, other), run_prefill(backend, other)
                failure = failure or _row_invariance_failure(backend, other, decoded, prefilled)
            return failure
    except RuntimeError as exc:
        return f"raised {exc}"
    return None


def _row_invariance_failure(
    backend: AttentionBackend, case: AttentionCase, decoded: torch.Tensor, prefilled: torch.Tensor
) -> str | None:
    for seq in (0, len(case.lens) // 2, len(case.lens) - 1):
        if not torch.equal(run_decode(backend, case, [seq])[0], decoded[seq]):
            return f"decode row {seq} alone differs from the same row in a batch"
    rows = [0, prefilled.shape[0] // 2, prefilled.shape[0] - 1]
    if not torch.equal(decode_chunk_rows(backend, case, rows), prefilled[rows]):
        return "prefill rows differ from the same tokens decoded"
    return None


def choose_attention(
    candidates: Sequence[AttentionBackend], shapes: Shapes
) -> tuple[AttentionBackend, list[Trial]]:
    case = attention_case(shapes)
    # Row invariance is also held on another batch and a short chunk near the start: a
    # kernel that splits its work by the batch or the chunk would show it there.
    other_shapes = [attention_case(shapes, batch=5, chunk=37, start=40)]
    reference = kernel_set.reference().attention
    expected = (run_decode(reference, case), run_prefill(reference, case))

    def workload(backend: AttentionBackend) -> None:
        run_decode(backend, case)
        run_prefill(backend, case)

    return pick(
        candidates,
        lambda backend: backend.name,
        lambda backend: check_attention(backend, case, expected, other_shapes),
        workload,
        preferred=attention_preference(candidates),
        timer=wall_timer(time.perf_counter, device_sync(shapes.device)),
    )


def attention_preference(
    candidates: Sequence[AttentionBackend],
) -> Callable[[AttentionBackend], bool]:
    """Row invariance where any candidate offers it; else reading the cache in place:
    TorchAttention's decode gathers every key into a buffer that the KV budget does not
    count (gigabytes at long contexts)."""
    if any(backend.row_invariant for backend in candidates):
        return lambda backend: backend.row_invariant
    return lambda backend: backend.paged


# ---- layer ops --------------------------------------------------------------------------


# What a layer runs between its matmuls, timed as a step runs it: a decode batch and a
# prefill chunk, every layer of a 1B model in one CUDA graph, the graph replayed back to
# back (on a CPU, where ops run as they are called, one layer of each).
TIMED_ROWS = (64, 256)
CHECKED_ROWS = 128  # the tokens a candidate's outputs are checked on
GRAPHED_LAYERS = 16
REPLAYS = 10


@dataclass(slots=True)
class LayerOpsCase:
    """One layer's small-op inputs on `rows` tokens of the model's shapes: the residual
    stream x and the delta added to it, a norm weight, gate_up, qkv, its positions' RoPE
    tables and a cache, each token writing the slot of its position."""

    x: torch.Tensor
    delta: torch.Tensor
    weight: torch.Tensor
    gate_up: torch.Tensor
    qkv: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    signed_sin: torch.Tensor
    kv: LayerKV
    heads: int
    kv_heads: int


def layer_ops_case(shapes: Shapes, rows: int) -> LayerOpsCase:
    generator = torch.Generator().manual_seed(1)
    dtype, device, d = shapes.dtype, shapes.device, shapes.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device, dtype)

    x, delta, weight = randn(rows, shapes.hidden), randn(rows, shapes.hidden), randn(shapes.hidden)
    gate_up = randn(rows, 2 * shapes.intermediate)
    qkv = randn(rows, (shapes.heads + 2 * shapes.kv_heads) * d)
    kv = shapes.cache(-(-rows // shapes.block_size), generator)
    # Real tables: a rotation keeps its values' size however often the timing repeats it.
    cos, signed_sin = rope_tables(d, Rope(10000.0), rows, dtype, device)
    positions = torch.arange(rows, device=device)
    return LayerOpsCase(
        x,
        delta,
        weight,
        gate_up,
        qkv,
        positions,
        cos,
        signed_sin,
        kv,
        shapes.heads,
        shapes.kv_heads,
    )


def run_layer_ops(ops: LayerOps, case: LayerOpsCase) -> list[torch.Tensor]:
    """Each op once on the case (x, qkv and the cache change in place) -> every output."""
    normed = ops.rms_norm(case.x, case.weight, 1e-5)
    added = ops.add_rms_norm_(case.x, case.delta, case.weight, 1e-5)
    activated = ops.silu_and_mul(case.gate_up)
    _rope_and_cache(ops, case)
    return [normed, added, case.x, activated, case.qkv, *case.kv.values(case.x.dtype)]


def run_layer(ops: LayerOps, case: LayerOpsCase) -> None:
    """The ops in the order a layer runs them: RoPE and the cache write before attention,
    the residual add and norm after it, the MLP's activation, the add and norm after it."""
    _rope_and_cache(ops, case)
    ops.add_rms_norm_(case.x, case.delta, case.weight, 1e-5)
    ops.silu_and_mul(case.gate_up)
    ops.add_rms_norm_(case.x, case.delta, case.weight, 1e-5)


def _rope_and_cache(ops: LayerOps, case: LayerOpsCase) -> None:
    slots = case.positions
    ops.rope_and_cache_(
        case.qkv,
        case.positions,
        case.cos,
        case.signed_sin,
        case.kv,
        slots,
        case.heads,
        case.kv_heads,
    )


def timed_layer_ops(
    ops: LayerOps, shapes: Shapes, capturer: PieceCapturer | None
) -> Callable[[], None]:
    """What the chooser times of `ops`, its inputs built here, outside the timing: with a
    capturer (CUDA's) REPLAYS replays of a graph of GRAPHED_LAYERS layers on each of
    TIMED_ROWS, as a step replays them; without, one layer on each, called eagerly."""
    cases = [layer_ops_case(shapes, rows) for rows in TIMED_ROWS]

    def layers() -> None:
        for _ in range(1 if capturer is None else GRAPHED_LAYERS):
            for case in cases:
                run_layer(ops, case)

    if capturer is None:
        return layers
    graph = capturer.capture(layers, capturer.new_pool())

    def replays() -> None:
        for _ in range(REPLAYS):
            graph.replay()

    return replays


def choose_layer_ops(
    candidates: Sequence[LayerOps], shapes: Shapes
) -> tuple[LayerOps, list[Trial]]:
    """The fastest candidate that agrees with the reference, timed as serving runs it
    (timed_layer_ops; on CUDA by events around back-to-back graph replays). One that
    raises, or cannot be captured, fails its check."""
    expected = run_layer_ops(kernel_set.reference().layer_ops, layer_ops_case(shapes, CHECKED_ROWS))
    tolerance = TOLERANCE[shapes.dtype]
    capturer = CudaPieceCapturer() if shapes.device.type == "cuda" else None
    timed: dict[int, Callable[[], None]] = {}

    def check(ops: LayerOps) -> str | None:
        try:
            outputs = run_layer_ops(ops, layer_ops_case(shapes, CHECKED_ROWS))
            for got, want in zip(outputs, expected, strict=True):
                if not torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance):
                    return "differs from the reference"
            timed[id(ops)] = timed_layer_ops(ops, shapes, capturer)
        except RuntimeError as exc:
            return f"raised {exc}"
        return None

    return pick(
        candidates,
        lambda ops: ops.name,
        check,
        lambda ops: timed[id(ops)](),
        timer=device_timer(shapes.device),
    )


# ---- matmul -----------------------------------------------------------------------------


def matmul_weights(shapes: Shapes) -> list[torch.Tensor]:
    """One layer's matmul weights, fused as the model holds them (qkv, o, gate_up, down)."""
    generator = torch.Generator().manual_seed(2)
    qkv_rows = (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim
    sizes = [
        (qkv_rows, shapes.hidden),
        (shapes.hidden, shapes.heads * shapes.head_dim),
        (2 * shapes.intermediate, shapes.hidden),
        (shapes.hidden, shapes.intermediate),
    ]
    return [
        (torch.randn(size, generator=generator) * 0.05).to(shapes.device, shapes.dtype)
        for size in sizes
    ]


# A lone stream's decode row, a full decode batch and a prefill chunk: a kernel twice as
# fast on the first and 5% slower on the last serves one user far better and a full
# machine about as well, so each workload weighs alike (by its time over the fastest's).
MATMUL_ROWS = (1, 64, 256)


def choose_matmul(candidates: Sequence[str], shapes: Shapes) -> tuple[str, list[Trial]]:
    """The candidate with the least sum, over MATMUL_ROWS, of its time over the fastest's;
    its trials' ms are its times summed."""
    weights = matmul_weights(shapes)
    generator = torch.Generator().manual_seed(3)
    inputs = {
        rows: [
            torch.randn(rows, w.shape[1], generator=generator).to(shapes.device, shapes.dtype)
            for w in weights
        ]
        for rows in MATMUL_ROWS
    }
    tolerance = TOLERANCE[shapes.dtype]
    linears: dict[str, list[Linear]] = {}

    def run(kind: str, rows: int) -> list[torch.Tensor]:
        if kind not in linears:
            linears[kind] = [Linear(w, kernel=kind) for w in weights]
        return [linear(x) for linear, x in zip(linears[kind], inputs[rows], strict=True)]

    def check(kind: str) -> str | None:
        for rows in MATMUL_ROWS:
            try:
                outputs = run(kind, rows)
            except RuntimeError as exc:
                return f"raised {exc}"
            for got, w, x in zip(outputs, weights, inputs[rows], strict=True):
                want = F.linear(x.float(), w.float())
                if not torch.allclose(got.float(), want, atol=tolerance, rtol=tolerance):
                    return f"differs from the float32 product on {rows} rows"
        return None

    failures = {kind: check(kind) for kind in candidates}
    passing = [kind for kind in candidates if failures[kind] is None]
    if not passing:
        raise NoCorrectKernel("; ".join(f"{kind}: {failures[kind]}" for kind in candidates))
    summed = dict.fromkeys(passing, 0.0)
    scores = dict.fromkeys(passing, 0.0)
    for rows in MATMUL_ROWS:
        workload = functools.partial(run, rows=rows)
        timer = wall_timer(time.perf_counter, device_sync(shapes.device))
        found = pick(passing, str, lambda kind: None, workload, timer=timer)
        timed = {t.name: t.ms or 0.0 for t in found[1]}
        fastest = max(min(timed.values()), 1e-3)
        for kind in passing:
            summed[kind] += timed[kind]
            scores[kind] += timed[kind] / fastest
    trials = [
        Trial(kind, None, failure) if failure is not None else Trial(kind, round(summed[kind], 3))
        for kind, failure in failures.items()
    ]
    return min(passing, key=scores.__getitem__), trials


# ---- measuring and the cache ------------------------------------------------------------


def machine() -> dict[str, str]:
    """What a choice depends on besides the shapes: the processor and the software."""
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
                break
    return {
        "cpu": model,
        "cpu_flags": hashlib.sha256(native.cpu_flags().encode()).hexdigest()[:16],
        # the instruction sets oneDNN and PyTorch may use, when capped (as the other-CPU
        # test runs do): what the machine's flags offer is not then what runs
        "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "kernel_sources": native.sources_digest(),
        "kernel_march": native.MARCH,
        "threads": str(torch.get_num_threads()),
    }


def _cache_key(shapes: Shapes, pins: dict[str, str]) -> str:
    """Everything the choice depends on, the candidates on offer included (a new one must
    be measured)."""
    offered = kernel_set.candidates(shapes.device, shapes.dtype, shapes.head_dim, shapes.layers)
    names = {seam: [kernel_set.name_of(c) for c in found] for seam, found in offered.items()}
    described = {
        **machine(),
        **{k: str(v) for k, v in asdict(shapes).items()},
        "pins": pins,
        "offered": names,
    }
    if shapes.device.type == "cuda":
        described["gpu"] = torch.cuda.get_device_name(shapes.device)
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def recall(path: Path | None, section: str) -> dict[str, Any]:
    """What was recorded under `section` on this machine (its processor and software)."""
    if path is None:
        return {}
    by_machine = _read_cache(path).get(section)
    found = by_machine.get(_machine_key()) if isinstance(by_machine, dict) else None
    return found if isinstance(found, dict) else {}


def record(path: Path | None, section: str, facts: dict[str, Any]) -> None:
    """Best effort, as the choice: `facts` become this machine's entry of `section`."""
    if path is None or facts == recall(path, section):
        return
    recorded = _read_cache(path)
    by_machine = recorded.get(section)
    by_machine = by_machine if isinstance(by_machine, dict) else {}
    by_machine[_machine_key()] = facts
    recorded[section] = by_machine
    _write_json(path, recorded)


def _machine_key() -> str:
    return hashlib.sha256(json.dumps(machine(), sort_keys=True).encode()).hexdigest()[:24]


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure
        return {}
    return recorded if isinstance(recorded, dict) else {}


def _write_cache(path: Path, key: str, choice: Choice) -> None:
    """Best effort: a worker that cannot write the cache measures again next time."""
    recorded = _read_cache(path)
    recorded[key] = {
        "names": choice.kernels.names(),
        "trials": {seam: [asdict(t) for t in trials] for seam, trials in choice.trials.items()},
        "machine": machine()["cpu"],
    }
    _write_json(path, recorded)


def _write_json(path: Path, recorded: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A name nobody can guess or plant beforehand (mkstemp opens it O_EXCL), in the
        # same directory so that the rename is atomic.
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as file:
                file.write(json.dumps(recorded, indent=1, sort_keys=True))
            os.replace(partial, path)
        except OSError:
            os.unlink(partial)
            raise
    except OSError:
        pass
