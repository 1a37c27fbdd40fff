"""The fused C++ layer ops against the PyTorch reference ops they replace on CPU, and the
compiled ones CUDA is offered."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from gpu_worker import kernel_choice, kernels, native
from gpu_worker.kv_cache import LayerKV
from gpu_worker.kv_quant import KV_CACHE_DTYPES, as_bytes, quantize_rows
from gpu_worker.layer_ops import CompiledLayerOps, NativeLayerOps, TorchLayerOps
from gpu_worker.model_config import Rope
from gpu_worker.rope import rope_tables

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def fused() -> NativeLayerOps:
    kernels = native.kernels()
    assert kernels is not None  # the suite's machines have a compiler and ninja
    return NativeLayerOps(kernels)


def rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def assert_at_most_one_ulp_apart(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for rare last-bit differences (another summation order, another exp)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.bfloat16:
        ulps = (got.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
        assert ulps.max() <= 1
        assert (ulps > 0).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_cpu_offers_the_fused_ops():
    offered = kernels.layer_ops_candidates(torch.device("cpu"))
    assert [type(ops) for ops in offered] == [TorchLayerOps, NativeLayerOps]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 40])  # 40: the scalar tail after two vectors
def test_rms_norm_matches(fused, dtype, width):
    x, weight = rows((33, width), dtype, 0, 3.0), rows((width,), dtype, 1)
    before = x.clone()
    assert_at_most_one_ulp_apart(
        fused.rms_norm(x, weight, 1e-5), TorchLayerOps().rms_norm(x, weight, 1e-5)
    )
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_exactly(fused, dtype):
    x, delta, weight = (
        rows((64, 576), dtype, 2, 4.0),
        rows((64, 576), dtype, 3),
        rows((576,), dtype, 4),
    )
    x_fused, x_torch = x.clone(), x.clone()
    got = fused.add_rms_norm_(x_fused, delta, weight, 1e-6)
    expected = TorchLayerOps().add_rms_norm_(x_torch, delta, weight, 1e-6)
    assert torch.equal(x_fused, x_torch)
    assert not torch.equal(x_fused, x)
    assert_at_most_one_ulp_apart(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 24])
def test_silu_and_mul_matches(fused, dtype, width):
    gate_up = rows((17, 2 * width), dtype, 5, 4.0)
    got = fused.silu_and_mul(gate_up)
    assert got.shape == (17, width)
    assert_at_most_one_ulp_apart(got, TorchLayerOps().silu_and_mul(gate_up))


def rope_case(dtype: torch.dtype, head_dim: int, cache_dtype: str | None = None):
    """A step's qkv rows and a layer's cache (8-bit when cache_dtype names one) with
    stale rows in it."""
    heads, kv_heads = 6, 2
    cos, sin = rope_tables(head_dim, Rope(10000.0), 64, dtype, torch.device("cpu"))
    tokens = 11
    qkv = rows((tokens, (heads + 2 * kv_heads) * head_dim), dtype, 6)
    positions = torch.randperm(64, generator=torch.Generator().manual_seed(7))[:tokens]
    cache_shape = (kv_heads, 9, 4, head_dim)  # 36 slots per head
    slots = torch.randperm(36, generator=torch.Generator().manual_seed(8))[:tokens]
    k, v = rows(cache_shape, dtype, 9), rows(cache_shape, dtype, 10)
    if cache_dtype is None:
        kv = LayerKV(k, v)
    else:
        (k, k_scales), (v, v_scales) = (
            quantize_rows(x, KV_CACHE_DTYPES[cache_dtype]) for x in (k, v)
        )
        kv = LayerKV(k, v, k_scales, v_scales)
    return qkv, positions, cos, sin, kv, slots, heads, kv_heads


def copy_of(kv: LayerKV) -> LayerKV:
    return LayerKV(
        *(None if t is None else t.clone() for t in (kv.k, kv.v, kv.k_scales, kv.v_scales))
    )


def same_cache(a: LayerKV, b: LayerKV) -> bool:
    pairs = zip(a.tensors, b.tensors, strict=True)
    return all(x is y is None or torch.equal(as_bytes(x), as_bytes(y)) for x, y in pairs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("cache_dtype", [None, "int8", "fp8"])
def test_rope_and_cache_is_exact(fused, dtype, head_dim, cache_dtype):
    qkv, positions, cos, sin, kv, slots, heads, kv_heads = rope_case(dtype, head_dim, cache_dtype)
    results = []
    for ops in (fused, TorchLayerOps()):
        out, written = qkv.clone(), copy_of(kv)
        ops.rope_and_cache_(out, positions, cos, sin, written, slots, heads, kv_heads)
        results.append((out, written))
    (out, written), (out_ref, written_ref) = results
    assert torch.equal(out, out_ref) and same_cache(written, written_ref)
    assert not torch.equal(out, qkv)  # it rotated something
    assert not same_cache(written, kv)  # and wrote the new keys


def test_rope_and_cache_rejects_a_slot_outside_the_cache(fused):
    qkv, positions, cos, sin, kv, slots, heads, kv_heads = rope_case(torch.float32, 64)
    slots[3] = kv.k.shape[1] * kv.k.shape[2]
    before = kv.k.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.rope_and_cache_(qkv, positions, cos, sin, kv, slots, heads, kv_heads)
    assert torch.equal(kv.k, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 21])  # 21: a scalar tail after one vector
def test_top_k_ids_take_the_largest_logits_best_first(fused, dtype, vocab):
    logits = rows((9, vocab), dtype, 11, 3.0)
    got = fused.top_k_ids(logits, 8)
    expected = TorchLayerOps().top_k_ids(logits, 8)
    assert got.shape == (9, 8) and got.dtype == torch.int64
    # bfloat16 logits tie often; the values chosen are what must agree, in order.
    assert torch.equal(logits.gather(1, got), logits.gather(1, expected))


def test_top_k_ids_break_ties_by_the_lower_id(fused):
    logits = torch.zeros(1, 40)
    logits[0, [30, 4, 17]] = 2.0
    assert fused.top_k_ids(logits, 4).tolist() == [[4, 17, 30, 0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_ops_trace_to_the_reference_with_lengths_dynamic(dtype):
    """Through dynamo with the eager backend (Inductor's fusion is CUDA's, checked there by
    the kernel chooser): the same values, a few graphs for any number of tokens."""
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = CompiledLayerOps(compiler=counter)
    shapes = kernel_choice.Shapes(6, 2, 16, 64, 96, 4, dtype, torch.device("cpu"), dtype)
    for count in (1, 5, 64, 100):
        got = kernel_choice.run_layer_ops(compiled, kernel_choice.layer_ops_case(shapes, count))
        want = kernel_choice.run_layer_ops(
            TorchLayerOps(), kernel_choice.layer_ops_case(shapes, count)
        )
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), count
    # Per function (4): one token (specialised), then every other length in one graph.
    assert counter.frame_count == 8
    torch._dynamo.reset()


def test_the_compiled_ops_are_offered_on_cuda_only():
    assert [ops.name for ops in kernels.layer_ops_candidates(torch.device("cuda"))] == [
        "torch",
        "compiled",
        "triton",
    ]
    assert "compiled" not in [ops.name for ops in kernels.layer_ops_candidates(torch.device("cpu"))]
