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
import os
import subprocess
import sys
from pathlib import Path

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

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
PARTITION = 512  # triton_backend.PARTITION, which this module does not import (see above)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
LAYERS = {
    "full": FULL,
    # Wider than a partition, narrower than the long contexts: partitions from its start.
    "window": LayerAttention(window=600),
    "softcap": LayerAttention(softcap=1.5),
    "window-softcap": LayerAttention(scale=0.3, window=50, softcap=1.5),
}


def make_case(
    dtype: str = "f32",
    group: int = 3,
    block_size: int = 16,
    length: str = "long",
    layer: str = "full",
    head_dim: int = 64,
) -> AttentionCase:
    """Five decode rows of 2 key/value heads of `group` query heads each, ragged contexts
    over shuffled tables: "short" ones (one partition: the kernel writes the output
    itself) or "long" ones (two: the merge kernel runs). One context fills its whole table
    (its last block exactly), one is a single token, one a block and a token, and a long
    case's fourth a whole partition."""
    shapes = Shapes(2 * group, 2, head_dim, 128, 256, block_size, DTYPES[dtype], CPU, DTYPES[dtype])
    case = attention_case(shapes, batch=5, chunk=8, start=40 if length == "short" else 600)
    case.lens[:3] = [block_size * case.tables.shape[1], 1, block_size + 1]
    if length == "long":
        case.lens[3] = PARTITION
    case.layer = LAYERS[layer]
    return case


CASES = {
    **{
        f"{dtype}-group{group}-block{block_size}-{length}": dict(
            dtype=dtype, group=group, block_size=block_size, length=length
        )
        for dtype in DTYPES
        for group in (1, 3, 4)
        for block_size in (16, 64)
        for length in ("short", "long")
    },
    **{
        f"{dtype}-{layer}-{length}": dict(dtype=dtype, layer=layer, length=length)
        for dtype in DTYPES
        for layer in ("window", "softcap", "window-softcap")
        for length in ("short", "long")
    },
    "f32-head_dim80": dict(head_dim=80),  # padded to 128 dims
}
INVARIANCE = ("f32-group3-block16-short", "bf16-group4-block16-long", "f32-window-long")
POISONED = ("f32-group3-block16-long", "f32-window-long", "bf16-group4-block64-short")


def wider(case: AttentionCase, width: int) -> DecodeGroup:
    """Every row's decode group over a table `width` blocks wide (as a captured graph's)."""
    tables = case.tables[:, : -(-max(case.lens) // case.kv.k.shape[2])]
    tables = F.pad(tables, (0, width - tables.shape[1]), value=0)
    return DecodeGroup(slice(None), tables, torch.tensor(case.lens), layer=case.layer)


def poisoned(case: AttentionCase) -> tuple[AttentionCase, DecodeGroup]:
    """The case with NaN in every key and value slot a row must not read, and its decode
    group: past its context and before its window, in its own first and last blocks, and
    in every other block of its table, which point at a NaN block added to the cache."""
    block_size, nan_block = case.kv.k.shape[2], case.kv.k.shape[1]
    k, v = (torch.cat([t, torch.full_like(t[:, :1], torch.nan)], 1) for t in (case.kv.k, case.kv.v))
    tables = case.tables[:, : -(-max(case.lens) // block_size)].clone()
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


def interpret(path: str) -> None:
    """Runs in the subprocess, under TRITON_INTERPRET=1: every output the tests compare."""
    from gpu_worker.attention.triton_backend import INTERPRETED, TritonAttention

    assert INTERPRETED, "TRITON_INTERPRET=1 must be set before triton_backend is imported"
    backend, outputs = TritonAttention(), {}
    for name, params in CASES.items():
        outputs[name] = run_decode(backend, make_case(**params))
    for name in INVARIANCE:
        case = make_case(**CASES[name])
        for row in (0, 2, 4):
            outputs[f"{name}/alone{row}"] = run_decode(backend, case, [row])[0]
        for width in (64, 200):  # two and seven partitions, at block size 16
            outputs[f"{name}/width{width}"] = backend.decode(
                case.q_decode, case.kv, wider(case, width)
            )
    for name in POISONED:
        case, group = poisoned(make_case(**CASES[name]))
        outputs[f"{name}/poisoned"] = backend.decode(case.q_decode, case.kv, group)
    torch.save(outputs, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, torch.Tensor]:
    path = tmp_path_factory.mktemp("triton") / "outputs.pt"
    command = (
        "import sys; from tests.test_worker_triton_attention import interpret; "
        "interpret(sys.argv[1])"
    )
    subprocess.run(
        [sys.executable, "-c", command, str(path)],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        check=True,
        timeout=300,
    )
    return torch.load(path)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = 1e-5 if want.dtype == torch.float32 else TOLERANCE[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    error = (got.float() - want.float()).abs().max().item()
    assert error < tolerance, f"differs from the reference by up to {error:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_the_reference(interpreted, name):
    # Ragged contexts over shuffled tables; GQA groups of 1, 3 and 4 padded to a tile of
    # 16; block sizes below and at the key tile; one partition and two, merged.
    case = make_case(**CASES[name])
    assert_close(interpreted[name], run_decode(TorchAttention(), case))


@pytest.mark.parametrize("name", POISONED)
def test_it_reads_nothing_outside_a_rows_context_or_window(interpreted, name):
    got = interpreted[f"{name}/poisoned"]
    assert got.isfinite().all()
    assert_close(got, run_decode(TorchAttention(), make_case(**CASES[name])))


@pytest.mark.parametrize("name", INVARIANCE)
def test_a_rows_bits_depend_on_neither_its_batch_nor_its_table_width(interpreted, name):
    batch = interpreted[name]
    for row in (0, 2, 4):
        assert torch.equal(interpreted[f"{name}/alone{row}"], batch[row])
    # Wider tables launch more partitions (the short case: the merge, where it had none).
    for width in (64, 200):
        assert torch.equal(interpreted[f"{name}/width{width}"], batch)


def test_an_8_bit_cache_is_refused_so_the_chooser_passes_over_it():
    from gpu_worker.attention.triton_backend import TritonAttention

    case = attention_case(Shapes(6, 2, 64, 128, 256, 16, torch.float32, CPU, torch.int8))
    with pytest.raises(RuntimeError, match="8-bit"):
        run_decode(TritonAttention(), case)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_its_prefill_is_flex_attentions():
    from gpu_worker.attention.triton_backend import TritonAttention

    backend = TritonAttention()
    assert backend.paged and backend.serves_layers(list(LAYERS.values()))
    assert not backend.row_invariant  # FlexAttention's prefill does not give its decode bits
    assert backend.compiles(torch.device("cuda")) and not backend.compiles(CPU)
    case = make_case(length="short")
    assert_close(run_prefill(backend, case), run_prefill(TorchAttention(), case))


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
