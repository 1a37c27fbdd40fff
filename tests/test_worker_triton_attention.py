"""TritonAttention, cadence's paged decode kernel for CUDA, run by Triton's CPU interpreter:
it must agree with the PyTorch reference on what a serving step gives it, read no key
outside a row's context or window, give a row the same bits whatever its batch and table
width, and be offered on CUDA only.

The interpreter takes over only where TRITON_INTERPRET=1 is set before a kernel is
decorated, which one pytest process running the whole suite cannot promise (another test
may have imported the module first): the kernels run in one subprocess, `interpret`, which
saves every case's output; the tests compare them here.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import pytest
import torch
import torch.nn.functional as F

from gpu_worker import kernels
from gpu_worker.attention import FULL, DecodeGroup, LayerAttention, TorchAttention
from gpu_worker.kernel_choice import (
    TOLERANCE,
    AttentionCase,
    Shapes,
    attention_case,
    run_decode,
    run_prefill,
)
from gpu_worker.kv_cache import LayerKV
from tests.triton_interpreter import interpreted_outputs

CPU = torch.device("cpu")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
LAYERS = {
    "full": FULL,
    # Wider than a segment's least, narrower than the long contexts.
    "window": LayerAttention(window=200),
    "softcap": LayerAttention(softcap=1.5),
    # Within two key tiles: a row's window straddles a tile boundary or not.
    "window-softcap": LayerAttention(scale=0.3, window=50, softcap=1.5),
}
# Nine ragged contexts by length (a case takes the first five, the invariance checks all
# nine): the longest, rounded up to a block so that it fills its table exactly, one
# token, a block and a token, then these. "short" ones fit in 128 keys (MIN_SEGMENT_KEYS:
# one segment, the kernel writes the output itself); "long" ones span up to 5 segments;
# "longest" ones reach MAX_SEGMENTS: 2304 keys are 18 tiles of 128 over 16 segments,
# unevenly (36 of 64 over 16).
CONTEXTS = {
    "short": (128, 100, 37, 64, 127, 2, 90),
    "long": (640, 300, 129, 500, 200, 33, 77),
    "longest": (2304, 700, 129, 2049, 256, 33, 1000),
}


def make_case(
    dtype: str = "f32",
    group: int = 3,
    block_size: int = 16,
    length: str = "long",
    layer: str = "full",
    head_dim: int = 64,
    batch: int = 5,
) -> AttentionCase:
    """Decode rows of 2 key/value heads of `group` query heads each, over shuffled tables."""
    longest, *rest = CONTEXTS[length]
    shapes = Shapes(2 * group, 2, head_dim, 128, 256, block_size, DTYPES[dtype], CPU, DTYPES[dtype])
    case = attention_case(shapes, batch=batch, chunk=8, start=longest + block_size)
    case.lens = [block_size * -(-longest // block_size), 1, block_size + 1, *rest][:batch]
    case.layer = LAYERS[layer]
    return case


# A cover of the space rather than its product: every key tile against the block size
# (128 keys over 8 blocks of 16 or 2 of 64; 64 keys over 4 blocks or in one of 64; 16
# keys, 3 to a block of 48), GQA groups of 1, 3, 4 and 8 (padded to a tile of 16), head
# dims 64, 80 (padded to 128) and 128, each kind of layer, both dtypes, split and not.
CASES = {
    "f32-group1-block16-short": dict(group=1, length="short"),
    "bf16-group3-block16-longest": dict(dtype="bf16", length="longest"),
    "f32-group4-block64-long": dict(group=4, block_size=64),
    "bf16-group8-block64-short": dict(dtype="bf16", group=8, block_size=64, length="short"),
    "f32-group8-block64-dim128-longest": dict(
        group=8, block_size=64, head_dim=128, length="longest"
    ),
    "bf16-group8-block16-dim128-long": dict(dtype="bf16", group=8, head_dim=128),
    "bf16-group4-block16-dim128-short": dict(dtype="bf16", group=4, head_dim=128, length="short"),
    "f32-group3-block16-dim80-long": dict(head_dim=80),
    "bf16-group1-block64-dim80-long": dict(dtype="bf16", group=1, block_size=64, head_dim=80),
    "f32-group4-block48-long": dict(group=4, block_size=48),
    "f32-window-long": dict(layer="window"),
    "bf16-window-block64-dim128-long": dict(
        dtype="bf16", group=4, block_size=64, head_dim=128, layer="window"
    ),
    "bf16-window-short": dict(dtype="bf16", layer="window", length="short"),
    "bf16-softcap-long": dict(dtype="bf16", layer="softcap"),
    "f32-softcap-short": dict(layer="softcap", length="short"),
    "f32-window-softcap-long": dict(layer="window-softcap"),
    "bf16-window-softcap-short": dict(dtype="bf16", layer="window-softcap", length="short"),
}
# At twice the width the short case's merge runs where it had none, and the long case's
# grid has 10 segments where it had 5: its longest row, 10 tiles of 64 keys, keeps its 5
# segments of 2 tiles (a split by the grid, as vLLM's, would give it 10 of one).
INVARIANCE = ("bf16-group8-block64-short", "f32-group3-block16-dim80-long", "f32-window-long")
ALONE = (0, 1, 3)  # the longest row, a one-token row (one segment alone), a middle one
POISONED = (
    "f32-window-long",
    "bf16-window-block64-dim128-long",
    "f32-group4-block48-long",
    "bf16-group8-block64-short",
)


@functools.cache
def case_named(name: str) -> AttentionCase:
    """CASES[name], built once a process (no test changes a case)."""
    return make_case(**CASES[name])


def natural_width(case: AttentionCase) -> int:
    return -(-max(case.lens) // case.kv.k.shape[2])


def wider(case: AttentionCase, width: int, rows: list[int] | None = None) -> DecodeGroup:
    """The decode group of `rows` (all) over a table `width` blocks wide (a graph's)."""
    rows = list(range(len(case.lens))) if rows is None else rows
    tables = case.tables[rows, : natural_width(case)]
    tables = F.pad(tables, (0, width - tables.shape[1]), value=0)
    lens = torch.tensor([case.lens[r] for r in rows])
    return DecodeGroup(slice(None), tables, lens, layer=case.layer)


def poisoned(case: AttentionCase) -> tuple[AttentionCase, DecodeGroup]:
    """The case with NaN in every key and value slot a row must not read, and its decode
    group: past its context and before its window, in its own first and last blocks, and
    in every other block of its table, which point at a NaN block added to the cache."""
    block_size, nan_block = case.kv.k.shape[2], case.kv.k.shape[1]
    k, v = (torch.cat([t, torch.full_like(t[:, :1], torch.nan)], 1) for t in (case.kv.k, case.kv.v))
    tables = case.tables[:, : natural_width(case)].clone()
    for row, length in enumerate(case.lens):
        first = 0 if case.layer.window is None else max(0, length - case.layer.window)
        for cache in (k, v):
            cache[:, tables[row, first // block_size], : first % block_size] = torch.nan
            cache[:, tables[row, (length - 1) // block_size], (length - 1) % block_size + 1 :] = (
                torch.nan
            )
        tables[row, : first // block_size] = nan_block
        tables[row, -(-length // block_size) :] = nan_block
    group = DecodeGroup(slice(None), tables, torch.tensor(case.lens), layer=case.layer)
    return dataclasses.replace(case, kv=LayerKV(k, v)), group


def with_an_empty_context(case: AttentionCase, width: int) -> DecodeGroup:
    group = wider(case, width)
    group.context_lens[1] = 0
    return group


def interpret(path: str) -> None:
    """Runs in the subprocess, under TRITON_INTERPRET=1: every output the tests compare."""
    from gpu_worker.attention.triton_backend import INTERPRETED, TritonAttention

    assert INTERPRETED, "TRITON_INTERPRET=1 must be set before triton_backend is imported"
    backend, outputs = TritonAttention(), {}
    for name in CASES:
        outputs[name] = run_decode(backend, case_named(name))
    for name in INVARIANCE:
        case = make_case(**CASES[name], batch=9)
        width = natural_width(case)
        outputs[f"{name}/batch9"] = run_decode(backend, case)
        outputs[f"{name}/batch5"] = run_decode(backend, case, range(5))
        outputs[f"{name}/batch9-width2w"] = backend.decode(
            case.q_decode, case.kv, wider(case, 2 * width)
        )
        for row in ALONE:
            outputs[f"{name}/alone{row}"] = run_decode(backend, case, [row])[0]
            outputs[f"{name}/alone{row}-width{width}"] = backend.decode(
                case.q_decode[[row]], case.kv, wider(case, width, [row])
            )[0]
    for name in POISONED:
        case, group = poisoned(case_named(name))
        outputs[f"{name}/poisoned"] = backend.decode(case.q_decode, case.kv, group)
    case = case_named("f32-group1-block16-short")
    for width in (8, 16):  # one segment, and two (the merge)
        outputs[f"empty/width{width}"] = backend.decode(
            case.q_decode, case.kv, with_an_empty_context(case, width)
        )
    torch.save(outputs, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, torch.Tensor]:
    return interpreted_outputs(__name__, tmp_path_factory)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = 1e-5 if want.dtype == torch.float32 else TOLERANCE[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    error = (got.float() - want.float()).abs().max().item()
    assert error < tolerance, f"differs from the reference by up to {error:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_the_reference(interpreted, name):
    case = case_named(name)
    assert_close(interpreted[name], run_decode(TorchAttention(), case))


def test_the_cases_cover_split_and_unsplit_launches_and_every_kind_of_tile():
    from gpu_worker.attention.triton_backend import MAX_SEGMENTS, split_for

    tiles = set()
    for name in CASES:
        case = case_named(name)
        block_size, head_dim = case.kv.k.shape[2], case.kv.k.shape[3]
        split = split_for(natural_width(case), block_size, head_dim, case.layer.window)
        assert (split.segments == 1) == name.endswith("-short"), name
        tiles.add((split.key_tile, block_size))
        if name.endswith("-longest"):
            assert split.segments == MAX_SEGMENTS  # 2304 keys: every row's most
    # Tiles across 8 and 2 blocks, 4 blocks, one whole block, a third of one.
    assert {(128, 16), (128, 64), (64, 16), (64, 64), (16, 48)} <= tiles


@pytest.mark.parametrize("name", POISONED)
def test_it_reads_nothing_outside_a_rows_context_or_window(interpreted, name):
    got = interpreted[f"{name}/poisoned"]
    assert got.isfinite().all()
    assert_close(got, run_decode(TorchAttention(), case_named(name)))


@pytest.mark.parametrize("name", INVARIANCE)
def test_a_rows_bits_depend_on_neither_its_batch_nor_its_table_width(interpreted, name):
    batch = interpreted[f"{name}/batch9"]
    assert torch.equal(interpreted[f"{name}/batch5"], batch[:5])
    assert torch.equal(interpreted[f"{name}/batch9-width2w"], batch)
    width = natural_width(make_case(**CASES[name], batch=9))
    for row in ALONE:  # at its own width (a one-token row: one segment) and the batch's
        assert torch.equal(interpreted[f"{name}/alone{row}"], batch[row])
        assert torch.equal(interpreted[f"{name}/alone{row}-width{width}"], batch[row])


def test_an_empty_context_reads_nothing_and_gives_zeros_split_or_not(interpreted):
    unsplit, split = interpreted["empty/width8"], interpreted["empty/width16"]
    assert torch.equal(unsplit[1], torch.zeros_like(unsplit[1]))
    assert torch.equal(split, unsplit)


class Recorder:
    """Stands in for a Triton kernel: keeps each launch's arguments instead of running."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def compiled_for_h200(kernel, args: tuple, kwargs: dict) -> str:
    """The kernel compiled for sm_90 with the specialization a launch with these arguments
    would get (a stride of 1 as a constant, 16-divisible values and pointers marked so), as
    Triton IR for the GPU."""
    from triton import compile
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs  # then the keywords
    signature, constants, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        kind, attr = (
            ("constexpr", value)
            if param.is_constexpr
            else native_specialize_impl(
                CUDABackend, value, False, not param.do_not_specialize, True
            )
        )
        signature[param.name] = kind
        if kind == "constexpr":
            constants[(index,)] = attr
        elif attr:
            attrs[(index,)] = CUDABackend.parse_attr(attr)
    source = ASTSource(kernel, signature, constants, attrs)
    return compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ttgir"]


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_it_compiles_for_an_h200_and_pipelines_its_gathers(monkeypatch):
    # The interpreter checks no GPU lowering: each launch paged_decode and paged_prefill
    # make is compiled for sm_90 as it would be at launch. Split and direct, windowed, a
    # tile over 8 blocks and one inside a block; the merge; a windowed chunk's prefill.
    from gpu_worker.attention import triton_backend, triton_varlen

    launches: list = []
    for module, name in (
        (triton_backend, "_segment_kernel"),
        (triton_backend, "_merge_kernel"),
        (triton_varlen, "_prefill_kernel"),
    ):
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), launches))
    for name in ("bf16-window-block64-dim128-long", "bf16-group3-block16-longest"):
        run_decode(triton_backend.TritonAttention(), case_named(name))
    run_prefill(triton_backend.TritonAttention(), case_named("bf16-window-block64-dim128-long"))
    assert len(launches) == 5  # two segment kernels, two merges, a prefill
    for kernel, args, kwargs in [*launches[:3], launches[4]]:  # (the second merge: the first's)
        ir = compiled_for_h200(kernel, args, kwargs)
        if kernel.__name__ != "_merge_kernel":  # K and V through cp.async, a stage ahead
            assert ir.count("async_copy_global_to_local") >= 2, kernel.__name__


def test_a_block_size_without_a_key_tile_is_refused():
    from gpu_worker.attention.triton_backend import TritonAttention

    # 24 keys: no power of two of 16 or more lies inside a block or spans whole ones.
    case = attention_case(Shapes(6, 2, 64, 128, 256, 24, torch.float32, CPU, torch.float32))
    with pytest.raises(RuntimeError, match="block size"):
        run_decode(TritonAttention(), case)


def test_an_8_bit_cache_is_refused_so_the_chooser_passes_over_it():
    from gpu_worker.attention.triton_backend import TritonAttention

    case = attention_case(Shapes(6, 2, 64, 128, 256, 16, torch.float32, CPU, torch.int8))
    with pytest.raises(RuntimeError, match="8-bit"):
        run_decode(TritonAttention(), case)


def test_it_claims_what_it_serves():
    from gpu_worker.attention.triton_backend import TritonAttention

    backend = TritonAttention()
    assert backend.paged and backend.serves_layers(list(LAYERS.values()))
    # Its prefill rows' bits are not its decode rows' (tests/test_worker_triton_varlen.py
    # checks the prefill kernel).
    assert not backend.row_invariant
    assert backend.compiles(torch.device("cuda")) and not backend.compiles(CPU)


def test_it_is_offered_on_cuda_only_after_flex():
    cuda = kernels.attention_candidates(torch.device("cuda"), torch.bfloat16, 64)
    assert [c.name for c in cuda] == ["torch", "flex", "triton"]
    assert "triton" not in [c.name for c in kernels.attention_candidates(CPU, torch.bfloat16, 64)]


def test_the_cpu_never_imports_it_and_cuda_without_triton_offers_the_rest(monkeypatch):
    monkeypatch.delitem(sys.modules, "gpu_worker.attention.triton_backend", raising=False)
    kernels.attention_candidates(CPU, torch.bfloat16, 64)
    assert "gpu_worker.attention.triton_backend" not in sys.modules
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    cuda = kernels.attention_candidates(torch.device("cuda"), torch.bfloat16, 64)
    assert [c.name for c in cuda] == ["torch", "flex"]
