"""TritonLayerOps, cadence's small-op kernels for CUDA, run by Triton's CPU interpreter:
each must give TorchLayerOps' values (bit for bit where it rounds as PyTorch does: RoPE,
the cache write, the residual add; within a last bit where a sum or an exp runs otherwise:
the norm, silu), give a row the same bits whatever its batch, pass the chooser's check,
and be offered on CUDA only.

As in tests/test_worker_triton_attention.py, the interpreter takes over only where
TRITON_INTERPRET=1 is set before the kernels are decorated: the kernels run in one
subprocess, `interpret`, which saves every output; the tests compare them here with the
PyTorch reference on the same inputs.
"""

from __future__ import annotations

import sys

import pytest
import torch

from gpu_worker import kernel_choice, kernels
from gpu_worker.kv_cache import LayerKV
from gpu_worker.kv_quant import as_bytes, quantize_rows
from gpu_worker.layer_ops import TorchLayerOps, rotate_
from gpu_worker.model_config import Rope
from gpu_worker.rope import rope_tables
from tests.triton_interpreter import interpreted_outputs

CPU = torch.device("cpu")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
ROWS = 9
BATCH = 37  # the batch whose rows are compared with the same rows alone
ALONE = (0, 18, 36)
NORMS = {f"{dtype}-{width}": (dtype, width) for dtype in DTYPES for width in (576, 40)}
SILUS = {f"{dtype}-{width}": (dtype, width) for dtype in DTYPES for width in (1536, 24)}
# (head_dim, heads, kv_heads, block_size): GQA groups of 1 to 8; 80 pads half a head to 64
GEOMETRIES = [(64, 2, 2, 16), (64, 9, 3, 64), (80, 8, 1, 16), (80, 4, 2, 64), (128, 8, 2, 16)]
ROPES = {
    f"{dtype}-d{d}-group{heads // kv}-block{bs}": (dtype, d, heads, kv, bs, None)
    for dtype in DTYPES
    for d, heads, kv, bs in GEOMETRIES
}
ROPES["bf16-d64-group3-block16-int8"] = ("bf16", 64, 6, 2, 16, torch.int8)  # written by torch


def rows(shape: tuple[int, ...], dtype: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(DTYPES[dtype])


def norm_inputs(name: str, count: int = ROWS) -> tuple[torch.Tensor, ...]:
    """x, delta and weight: x's rows of mixed sizes, so the norm's scale differs by row."""
    dtype, width = NORMS[name]
    scales = torch.linspace(0.1, 8.0, count)[:, None]
    x = (rows((count, width), "f32", 0) * scales).to(DTYPES[dtype])
    return x, rows((count, width), dtype, 1), rows((width,), dtype, 2)


def silu_inputs(name: str, count: int = ROWS) -> torch.Tensor:
    dtype, width = SILUS[name]
    return rows((count, 2 * width), dtype, 3, 4.0)


def rope_inputs(name: str, tokens: int = 7) -> tuple:
    """A step's qkv and a cache with stale rows; tokens at distinct positions, writing
    distinct slots scattered over the cache's blocks (ragged, out of order)."""
    dtype, d, heads, kv_heads, block_size, cache_dtype = ROPES[name]
    cos, sin = rope_tables(d, Rope(10000.0), 64, DTYPES[dtype], CPU)
    qkv = rows((tokens, (heads + 2 * kv_heads) * d), dtype, 4)
    generator = torch.Generator().manual_seed(5)
    positions = torch.randperm(64, generator=generator)[:tokens]
    slots = torch.randperm(5 * block_size, generator=generator)[:tokens]
    k, v = (rows((kv_heads, 5, block_size, d), dtype, seed) for seed in (6, 7))
    if cache_dtype is None:
        kv = LayerKV(k, v)
    else:
        (k, k_scales), (v, v_scales) = (quantize_rows(t, cache_dtype) for t in (k, v))
        kv = LayerKV(k, v, k_scales, v_scales)
    return qkv, positions, cos, sin, kv, slots, heads, kv_heads


def copy_of(kv: LayerKV) -> LayerKV:
    return LayerKV(*(None if t is None else t.clone() for t in kv.tensors))


def rope_and_cache(ops, inputs: tuple) -> tuple[torch.Tensor, LayerKV]:
    """The ops on copies of the inputs -> the rotated qkv and the written cache."""
    qkv, positions, cos, sin, kv, slots, heads, kv_heads = inputs
    qkv, kv = qkv.clone(), copy_of(kv)
    ops.rope_and_cache_(qkv, positions, cos, sin, kv, slots, heads, kv_heads)
    return qkv, kv


def select(inputs: tuple, tokens: list[int]) -> tuple:
    """The inputs of only `tokens`: a smaller batch of the same rows."""
    qkv, positions, cos, sin, kv, slots, heads, kv_heads = inputs
    return qkv[tokens], positions[tokens], cos, sin, kv, slots[tokens], heads, kv_heads


def out_of_range_inputs() -> tuple:
    """Tokens 2 and 4 of a case with slots past the cache's end and below it."""
    inputs = rope_inputs("bf16-d64-group3-block64")
    slots = inputs[5].clone()
    slots[2], slots[4] = inputs[4].k.shape[1] * inputs[4].k.shape[2], -1
    return (*inputs[:5], slots, *inputs[6:])


def chooser_shapes(cache_dtype: torch.dtype) -> kernel_choice.Shapes:
    return kernel_choice.Shapes(4, 2, 64, 96, 80, 16, torch.bfloat16, CPU, cache_dtype)


def interpret(path: str) -> None:
    """Runs in the subprocess, under TRITON_INTERPRET=1: every output the tests compare."""
    from gpu_worker.triton_layer_ops import INTERPRETED, TritonLayerOps

    assert INTERPRETED, "TRITON_INTERPRET=1 must be set before triton_layer_ops is imported"
    ops, outputs = TritonLayerOps(), {}
    for name in NORMS:
        x, delta, weight = norm_inputs(name)
        outputs[f"norm/{name}"] = ops.rms_norm(x, weight, 1e-5)
        outputs[f"add_norm/{name}"] = ops.add_rms_norm_(x, delta, weight, 1e-5)
        outputs[f"added/{name}"] = x
    for name in SILUS:
        outputs[f"silu/{name}"] = ops.silu_and_mul(silu_inputs(name))
    for name in ROPES:
        outputs[f"rope/{name}"] = rope_and_cache(ops, rope_inputs(name))
    outputs["rope/out-of-range"] = rope_and_cache(ops, out_of_range_inputs())
    interpret_batches(ops, outputs)
    # The chooser's own check and timing, on few rows: the interpreter is slow.
    kernel_choice.CHECKED_ROWS, kernel_choice.TIMED_ROWS = 8, (3,)
    for cache_dtype in (torch.bfloat16, torch.int8):
        shapes = chooser_shapes(cache_dtype)
        _, trials = kernel_choice.choose_layer_ops([TorchLayerOps(), ops], shapes)
        outputs[f"chooser/{cache_dtype}"] = {t.name: t.failed for t in trials}
    torch.save(outputs, path)


def interpret_batches(ops, outputs: dict) -> None:
    """A batch of BATCH rows, and ALONE's rows each alone."""
    x, delta, weight = norm_inputs("bf16-576", BATCH)
    gate_up = silu_inputs("bf16-1536", BATCH)
    inputs = rope_inputs("bf16-d80-group8-block16", BATCH)
    for tokens in [list(range(BATCH))] + [[row] for row in ALONE]:
        key = "batch" if len(tokens) > 1 else f"alone{tokens[0]}"
        outputs[f"{key}/add_norm"] = ops.add_rms_norm_(x[tokens], delta[tokens], weight, 1e-5)
        outputs[f"{key}/silu"] = ops.silu_and_mul(gate_up[tokens])
        outputs[f"{key}/rope"] = rope_and_cache(ops, select(inputs, tokens))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return interpreted_outputs(__name__, tmp_path_factory)


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Each element's distance in bfloat16 units in the last place, after rounding both
    to bfloat16."""
    assert got.dtype == want.dtype and got.shape == want.shape
    a, b = (t.to(torch.bfloat16).view(torch.int16).int() for t in (got, want))
    return (a - b).abs()


def assert_within_a_last_bit(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within a few of its own last bits; rounded to bfloat16, at most one unit
    apart, and equal but for rare elements."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    ulps = ulps_apart(got, want)
    assert ulps.max() <= 1
    assert (ulps == 0).float().mean() >= 0.99


def same_cache(a: LayerKV, b: LayerKV) -> bool:
    pairs = zip(a.tensors, b.tensors, strict=True)
    return all(x is y is None or torch.equal(as_bytes(x), as_bytes(y)) for x, y in pairs)


@pytest.mark.parametrize("name", list(NORMS))
def test_the_norms_match_the_reference_within_a_last_bit(interpreted, name):
    # A float32 sum of squares in another order: a last bit, rarely one in bfloat16.
    x, delta, weight = norm_inputs(name)
    reference = TorchLayerOps()
    assert_within_a_last_bit(interpreted[f"norm/{name}"], reference.rms_norm(x, weight, 1e-5))
    expected = reference.add_rms_norm_(x, delta, weight, 1e-5)
    assert_within_a_last_bit(interpreted[f"add_norm/{name}"], expected)


@pytest.mark.parametrize("name", list(NORMS))
def test_the_residual_add_is_exact_and_in_place(interpreted, name):
    x, delta, weight = norm_inputs(name)
    before = x.clone()
    TorchLayerOps().add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(interpreted[f"added/{name}"], x)
    assert not torch.equal(x, before)


@pytest.mark.parametrize("name", list(SILUS))
def test_silu_and_mul_matches_the_reference_within_a_last_bit(interpreted, name):
    # PyTorch's silu runs in float32 and rounds once, then the product rounds: the kernel
    # too. Only the exp may differ (numpy's here, libdevice's on CUDA).
    gate_up = silu_inputs(name)
    got = interpreted[f"silu/{name}"]
    assert got.shape == (ROWS, gate_up.shape[1] // 2)
    assert_within_a_last_bit(got, TorchLayerOps().silu_and_mul(gate_up))


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_and_the_cache_write_are_exact(interpreted, name):
    inputs = rope_inputs(name)
    qkv, kv = interpreted[f"rope/{name}"]
    want_qkv, want_kv = rope_and_cache(TorchLayerOps(), inputs)
    assert torch.equal(qkv, want_qkv) and same_cache(kv, want_kv)
    assert not torch.equal(qkv, inputs[0])  # it rotated something
    assert not same_cache(kv, inputs[4])  # and wrote the new keys


def test_a_slot_outside_the_cache_is_not_written(interpreted):
    inputs = out_of_range_inputs()
    qkv, kv = interpreted["rope/out-of-range"]
    kept = [t for t in range(inputs[0].shape[0]) if t not in (2, 4)]
    _, want_kv = rope_and_cache(TorchLayerOps(), select(inputs, kept))
    assert same_cache(kv, want_kv)
    # Every token is rotated all the same.
    want_qkv, (_, d, heads, kv_heads, _, _) = inputs[0].clone(), ROPES["bf16-d64-group3-block64"]
    qk = want_qkv[:, : (heads + kv_heads) * d].view(-1, heads + kv_heads, d)
    rotate_(qk, inputs[1], inputs[2], inputs[3])
    assert torch.equal(qkv, want_qkv)


@pytest.mark.parametrize("op", ["add_norm", "silu"])
def test_a_rows_bits_do_not_depend_on_its_batch(interpreted, op):
    for row in ALONE:
        assert torch.equal(interpreted[f"alone{row}/{op}"][0], interpreted[f"batch/{op}"][row])


def test_a_tokens_rotation_and_cache_rows_do_not_depend_on_its_batch(interpreted):
    batch_qkv, batch_kv = interpreted["batch/rope"]
    slots = rope_inputs("bf16-d80-group8-block16", BATCH)[5]
    for row in ALONE:
        qkv, kv = interpreted[f"alone{row}/rope"]
        assert torch.equal(qkv[0], batch_qkv[row])
        for cache, batch_cache in ((kv.k, batch_kv.k), (kv.v, batch_kv.v)):
            flat, batch_flat = (c.view(c.shape[0], -1, c.shape[3]) for c in (cache, batch_cache))
            assert torch.equal(flat[:, slots[row]], batch_flat[:, slots[row]])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_it_passes_the_choosers_check(interpreted, cache_dtype):
    assert interpreted[f"chooser/{cache_dtype}"] == {"torch": "", "triton": ""}


def hopper_ptx(kernel, types: dict[str, str], constants: dict) -> str:
    """The kernel compiled for an H100/H200 (sm_90) as a launch would, without a GPU: the
    front end the interpreter skips, the lowering, and ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpu_worker import triton_layer_ops as ops

    signature = {
        name: "constexpr" if name in constants else types.get(name, "i32")
        for name in kernel.arg_names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    options = {"num_warps": 4, **ops.LAUNCH_OPTIONS}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_hopper_rounding_as_pytorch(dtype):
    from gpu_worker import triton_layer_ops as ops

    pointer = f"*{dtype}"
    norm = {name: pointer for name in ("x_ptr", "delta_ptr", "weight_ptr", "out_ptr")}
    constants = dict(WIDTH=576, BLOCK=1024, ADD=True, INTERPRETED=False)
    hopper_ptx(ops._rms_norm_kernel, {**norm, "eps": "fp32"}, constants)
    silu = {"gate_up_ptr": pointer, "out_ptr": pointer}
    constants = dict(WIDTH=1536, TILE=1024, INTERPRETED=False)
    assert "div.rn.f32" in hopper_ptx(ops._silu_and_mul_kernel, silu, constants)
    rope = dict.fromkeys(("qkv_ptr", "cos_ptr", "sin_ptr", "k_ptr", "v_ptr"), pointer)
    rope |= {"positions_ptr": "*i64", "slots_ptr": "*i64"}
    for write in (True, False):
        constants = dict(
            HEADS=8, KV_HEADS=1, HEADS_PAD=16, HALF=40, HALF_PAD=64, BLOCK_SIZE=16
        ) | dict(WRITE=write, INTERPRETED=False)
        # Contracted, a product and the sum would round once (fma), even in bfloat16.
        assert "fma" not in hopper_ptx(ops._rope_and_cache_kernel, rope, constants)


def test_no_rows_launch_nothing():
    """Shape checks only, in this process (no interpreter): an empty batch never reaches
    a kernel, which a CPU tensor would fail."""
    from gpu_worker.triton_layer_ops import TritonLayerOps

    ops = TritonLayerOps()
    x, weight = torch.empty(0, 64), torch.ones(64)
    assert ops.add_rms_norm_(x, x, weight, 1e-5).shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 48)).shape == (0, 24)
    qkv, positions, cos, sin, kv, slots, heads, kv_heads = rope_inputs("f32-d64-group1-block16")
    ops.rope_and_cache_(qkv[:0], positions[:0], cos, sin, kv, slots[:0], heads, kv_heads)


def test_it_is_offered_on_cuda_only_and_compiles_there():
    from gpu_worker.triton_layer_ops import TritonLayerOps

    cuda = kernels.layer_ops_candidates(torch.device("cuda"))
    assert [ops.name for ops in cuda] == ["torch", "compiled", "triton"]
    assert "triton" not in [ops.name for ops in kernels.layer_ops_candidates(CPU)]
    assert TritonLayerOps().compiles(torch.device("cuda")) and not TritonLayerOps().compiles(CPU)


def test_the_cpu_never_imports_it_and_cuda_without_triton_offers_the_rest(monkeypatch):
    monkeypatch.delitem(sys.modules, "gpu_worker.triton_layer_ops", raising=False)
    kernels.layer_ops_candidates(CPU)
    assert "gpu_worker.triton_layer_ops" not in sys.modules
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    cuda = kernels.layer_ops_candidates(torch.device("cuda"))
    assert [ops.name for ops in cuda] == ["torch", "compiled"]
