"""TritonAttention's prefill, cadence's varlen paged kernel for prompt chunks, run by Triton's
CPU interpreter: a step's chunks (at position 0 and after a cached prefix, beside decode
rows) in one launch must agree with the PyTorch reference, read no key outside a query's
context or window, and give each chunk the bits it gets in a launch of its own.

As in tests/test_worker_triton_attention.py, the kernels run in one subprocess under
TRITON_INTERPRET=1, `interpret`, which saves every output; the tests compare them here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpu_worker.attention import (
    FULL,
    AttentionBackend,
    LayerAttention,
    PrefillChunk,
    TorchAttention,
    metadata_for,
    paged_attention,
)
from gpu_worker.kernel_choice import TOLERANCE
from gpu_worker.kv_cache import LayerKV
from gpu_worker.layer_ops import write_kv
from gpu_worker.static_records import StaticRecords, StepRows
from tests.triton_interpreter import interpreted_outputs

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
KV_HEADS = 2


@dataclass(frozen=True, slots=True)
class StepCase:
    """A step's rows, (start position, new tokens) each: a row of one token decodes."""

    rows: tuple[tuple[int, int], ...]
    dtype: str = "f32"
    group: int = 1
    head_dim: int = 64
    block_size: int = 16
    layer: LayerAttention = FULL


# A cover rather than a product: chunks of 5, 37, 64 and 130 tokens at position 0 and after
# a cached prefix, several to a launch and beside decode rows; GQA groups of 1, 3, 4 and 8
# (3 leaves a 64-row tile one row idle); head dims 64, 80 (padded to 128) and 128; key tiles
# over 8 blocks of 16, 2 of 64, inside one of 64 and 3 to a block of 48; windows whose first
# key tile some queries of a query tile do not see, soft-capping; both dtypes; attention
# sinks (gpt-oss) in both kernels: decode rows merged from segments, and of one segment.
CASES = {
    "f32-group1-three-chunks": StepCase(((0, 130), (40, 5), (0, 64))),
    "bf16-group4-dim128-block64-beside-decodes": StepCase(
        ((300, 64), (77, 1), (0, 5), (500, 1)), "bf16", 4, 128, 64
    ),
    "bf16-group8-dim80-window-softcap": StepCase(
        ((200, 130),), "bf16", 8, 80, 16, LayerAttention(scale=0.3, window=50, softcap=1.5)
    ),
    "f32-group4-block64-window": StepCase(
        ((0, 130), (150, 64)), "f32", 4, 64, 64, LayerAttention(window=200)
    ),
    "bf16-group1-softcap": StepCase(((500, 5), (0, 64)), "bf16", layer=LayerAttention(softcap=1.5)),
    "f32-group3-dim80-block48": StepCase(((100, 37),), "f32", 3, 80, 48),
    "bf16-group4-sinks-beside-decodes": StepCase(
        ((300, 64), (77, 1), (0, 5), (500, 1)), "bf16", 4, layer=LayerAttention(sinks=True)
    ),
    "f32-group2-window-sinks-one-segment": StepCase(
        ((0, 40), (20, 1), (30, 1)), "f32", 2, layer=LayerAttention(window=16, sinks=True)
    ),
}
ALONE = ("f32-group1-three-chunks", "f32-group4-block64-window")
# Steps from static records, as a graph captured whole replays them (gpu_worker.static_records)
CAPTURED = ("bf16-group4-dim128-block64-beside-decodes", "f32-group1-three-chunks")
PADDING_TOKENS, WIDER_BY, MAX_SEQS = 16, 5, 8


@dataclass(slots=True)
class Step:
    """A case's inputs: q, k, v of every new token, and its cache twice: poisoned (NaN in
    every slot no row may read, and in a block the tables point at where they hold none)
    for the kernel, and clean (those slots random) for the reference, which masks scores
    by adding -inf and so cannot take NaN keys."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    poisoned: LayerKV
    clean: LayerKV
    tables: torch.Tensor
    sinks: torch.Tensor | None  # [heads], where the case's layer has them


@functools.cache
def step_of(name: str) -> Step:
    case = CASES[name]
    generator = torch.Generator().manual_seed(0)
    dtype, bs, d, window = DTYPES[case.dtype], case.block_size, case.head_dim, case.layer.window
    width = max(-(-(start + count) // bs) for start, count in case.rows)
    nan_block = len(case.rows) * width

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(dtype)

    clean = LayerKV(*(randn(KV_HEADS, nan_block + 1, bs, d) for _ in range(2)))
    poisoned = LayerKV(*(torch.full_like(t, torch.nan) for t in (clean.k, clean.v)))
    tables = torch.randperm(nan_block, generator=generator).view(len(case.rows), width)
    tokens = sum(count for _, count in case.rows)
    k, v = randn(tokens, KV_HEADS, d), randn(tokens, KV_HEADS, d)
    row = 0
    for seq, (start, count) in enumerate(case.rows):
        first = 0 if window is None else max(0, start - window + 1)  # its first query's
        positions = torch.arange(first, start + count)
        slots = tables[seq, positions // bs] * bs + positions % bs
        for cache, source in ((poisoned.k, clean.k), (poisoned.v, clean.v)):
            cache.view(KV_HEADS, -1, d)[:, slots] = source.view(KV_HEADS, -1, d)[:, slots]
        new = slice(row, row + count)
        for kv in (poisoned, clean):  # as rope_and_cache_ writes them before attention
            write_kv(kv, k[new], v[new], slots[start - first :])
        tables[seq, : first // bs] = nan_block  # blocks wholly behind the window: freed
        tables[seq, -(-(start + count) // bs) :] = nan_block
        row += count
    heads = KV_HEADS * case.group
    q = randn(tokens, heads, d)
    # near the rows' log-sum-exps, so that a sink takes a real share of its row
    sinks = 3 + 2 * randn(heads) if case.layer.sinks else None
    return Step(q, k, v, poisoned, clean, tables, sinks)


def run_step(name: str, backend: AttentionBackend, kv: LayerKV) -> torch.Tensor:
    """The whole step's attention [T, heads * d] through paged_attention, as a layer runs it."""
    case, step = CASES[name], step_of(name)
    meta = metadata_for(
        [count for _, count in case.rows],
        [start for start, _ in case.rows],
        step.tables,
        torch.zeros(step.q.shape[0], dtype=torch.long),
        kv.k,
        case.group,
        backend,
        case.layer,
    )
    return paged_attention(step.q, step.k, step.v, kv, meta, step.sinks)


def run_alone(name: str, backend: AttentionBackend, kv: LayerKV) -> list[torch.Tensor]:
    """Each chunk of the step through `prefill`, a launch of its own."""
    case, step = CASES[name], step_of(name)
    outputs, row = [], 0
    for seq, (start, count) in enumerate(case.rows):
        rows = slice(row, row + count)
        chunk = PrefillChunk(rows, start, start + count, step.tables[seq], layer=case.layer)
        chunk = backend.prefill_chunk(chunk, step.tables[seq], kv.k)
        outputs.append(backend.prefill(step.q[rows], step.k[rows], step.v[rows], kv, chunk))
        row += count
    return outputs


def run_captured(name: str, backend: AttentionBackend, kv: LayerKV) -> torch.Tensor:
    """The step through static records, padded as a graph replays it: PADDING_TOKENS more
    tokens than its own, chunk and decode slots to spare, tables wider than its rows' and
    the tables' padding row (PAD_SLOT) naming the poisoned block."""
    case, step = CASES[name], step_of(name)
    tokens, bucket, poisoned = step.q.shape[0], step.q.shape[0] + PADDING_TOKENS, kv.k.shape[1] - 1
    rows, width = step.tables.shape
    held = torch.full((1, rows + 1, width + WIDER_BY), poisoned, dtype=torch.long)
    held[0, 1:, :width] = step.tables  # the table rows after PAD_SLOT's
    records = StaticRecords(
        backend, [case.layer], width + WIDER_BY, bucket, MAX_SEQS, kv.k, case.group, poisoned
    )
    counts = np.array([count for _, count in case.rows])
    starts = np.array([start for start, _ in case.rows])
    records.write(
        StepRows(counts, np.cumsum(counts) - counts, starts, np.arange(1, rows + 1)), bucket, held
    )
    (meta,) = records.metadata(bucket, torch.zeros((1, bucket), dtype=torch.long))
    padded = [F.pad(t, (0, 0, 0, 0, 0, PADDING_TOKENS)) for t in (step.q, step.k, step.v)]
    return paged_attention(*padded, kv, meta)[:tokens]


def run_decodes_alone(name: str, backend: AttentionBackend, kv: LayerKV) -> torch.Tensor:
    """The step's decode rows alone: a decode-only step."""
    case, step = CASES[name], step_of(name)
    counts = [count for _, count in case.rows]
    decodes = [seq for seq, count in enumerate(counts) if count == 1]
    rows = [sum(counts[:seq]) for seq in decodes]
    meta = metadata_for(
        [1] * len(decodes),
        [case.rows[seq][0] for seq in decodes],
        step.tables[decodes],
        torch.zeros(len(decodes), dtype=torch.long),
        kv.k,
        case.group,
        backend,
        case.layer,
    )
    return paged_attention(step.q[rows], step.k[rows], step.v[rows], kv, meta)


def one_token_chunk(kv: LayerKV, backend: AttentionBackend) -> torch.Tensor:
    """A chunk of one token after a prefix (the step builder would make it a decode row)."""
    step = step_of("bf16-group4-dim128-block64-beside-decodes")
    chunk = PrefillChunk(slice(64, 65), 77, 78, step.tables[1])
    chunk = backend.prefill_chunk(chunk, step.tables[1], kv.k)
    return backend.prefill(step.q[64:65], step.k[64:65], step.v[64:65], kv, chunk)


def interpret(path: str) -> None:
    """Runs in the subprocess, under TRITON_INTERPRET=1: every output the tests compare."""
    from gpu_worker.attention.triton_backend import TritonAttention
    from gpu_worker.attention.triton_tiles import INTERPRETED

    assert INTERPRETED, "TRITON_INTERPRET=1 must be set before the kernels are imported"
    backend, outputs = TritonAttention(), {}
    for name in CASES:
        outputs[name] = run_step(name, backend, step_of(name).poisoned)
    for name in ALONE:
        for index, out in enumerate(run_alone(name, backend, step_of(name).poisoned)):
            outputs[f"{name}/alone{index}"] = out
    for name in CAPTURED:
        outputs[f"{name}/captured"] = run_captured(name, backend, step_of(name).poisoned)
    name = "bf16-group4-dim128-block64-beside-decodes"
    outputs[f"{name}/decodes"] = run_decodes_alone(name, backend, step_of(name).poisoned)
    step = step_of("bf16-group4-dim128-block64-beside-decodes")
    outputs["one-token"] = one_token_chunk(step.poisoned, backend)
    torch.save(outputs, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, torch.Tensor]:
    return interpreted_outputs(__name__, tmp_path_factory)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = 1e-5 if want.dtype == torch.float32 else TOLERANCE[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.isfinite().all(), "a NaN key or value was read"
    error = (got.float() - want.float()).abs().max().item()
    assert error < tolerance, f"differs from the reference by up to {error:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_a_steps_chunks_in_one_launch_match_the_reference_reading_nothing_unseen(interpreted, name):
    assert_close(interpreted[name], run_step(name, TorchAttention(), step_of(name).clean))


@pytest.mark.parametrize("name", ALONE)
def test_a_chunk_has_the_same_bits_alone_as_among_others(interpreted, name):
    step, row = interpreted[name], 0
    for index, (_, count) in enumerate(CASES[name].rows):
        alone = interpreted[f"{name}/alone{index}"]
        assert torch.equal(alone.flatten(1), step[row : row + count])
        row += count


@pytest.mark.parametrize("name", CAPTURED)
def test_a_step_from_static_records_has_the_eager_steps_bits(interpreted, name):
    # padding tokens, empty chunk and decode slots and wider tables change no row's bits
    assert torch.equal(interpreted[f"{name}/captured"], interpreted[name])


def test_a_decode_row_has_the_same_bits_beside_chunks_as_without(interpreted):
    name = "bf16-group4-dim128-block64-beside-decodes"  # decode rows 64 and 70
    step, alone = interpreted[name], interpreted[f"{name}/decodes"]
    assert torch.equal(step[[64, 70]], alone)


def test_a_one_token_chunk_matches_the_reference(interpreted):
    step = step_of("bf16-group4-dim128-block64-beside-decodes")
    assert_close(interpreted["one-token"], one_token_chunk(step.clean, TorchAttention()))


def test_a_steps_chunks_are_one_launch_per_layer(monkeypatch):
    from gpu_worker.attention import triton_backend, triton_varlen
    from tests.test_worker_triton_attention import Recorder

    launches: list = []
    for module, name in (
        (triton_varlen, "_prefill_kernel"),
        (triton_backend, "_segment_kernel"),
        (triton_backend, "_merge_kernel"),
    ):
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), launches))
    name = "bf16-group4-dim128-block64-beside-decodes"  # two chunks, two decode rows
    run_step(name, triton_backend.TritonAttention(), step_of(name).clean)
    kernels = [kernel.__name__ for kernel, _, _ in launches]
    assert kernels == ["_prefill_kernel", "_segment_kernel", "_merge_kernel"]


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 7])
def test_the_chunks_lists_are_aligned_whatever_their_count(chunks):
    # Triton compiles a variant per pointer alignment: one per count would compile while
    # serving, where warm-up ran single chunks.
    from gpu_worker.attention.triton_varlen import chunks_on

    record = chunks_on(
        torch.device("cpu"), [0] * chunks, [2] * chunks, [0] * chunks, torch.zeros(chunks, 4)
    )
    for values in (record.cu_q, record.rows, record.starts):
        assert values.data_ptr() % 16 == 0
    assert record.cu_q.tolist() == [2 * c for c in range(chunks + 1)]
