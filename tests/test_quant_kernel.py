"""The quantized matmul (gpu_worker.quant, csrc/quant_matmul.cpp): the C++ kernel gives the
PyTorch reference's bits, the reference is the dequantized weight's product within the
activations' rounding, and a row's bits never depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import kernels
from gpu_worker.quant import (
    QuantLinear,
    QuantWeight,
    e8m0_scales,
    pack,
    quantize_activations,
    quantize_int4,
    quantize_int8,
    reference_matmul,
)


@pytest.fixture(scope="module")
def native():
    found = kernels.quant_kernels(torch.device("cpu"))
    assert found is not None  # the suite's machines have AVX2 or more, a compiler and ninja
    return found


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def random_q8(n: int, k: int, group: int, mins: bool, low: int = -128, high: int = 128):
    generator = torch.Generator().manual_seed(n + k + group)
    values = torch.randint(low, high, (n, k), generator=generator, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=generator) * 0.01
    offsets = torch.randn(n, k // group, generator=generator) * 0.1 if mins else None
    return QuantWeight("q8", values, scales, offsets, group)


# Every format the kernel has: int8 and int4 quantized, q8 in groups of 16 (Q6_K), q8 with
# mins, q4 with min = -8 scale (Q4_0), q5 with min = -16 scale (Q5_0) and with mins (Q5_1,
# Q5_K). 40 columns: a partial column block.
FORMATS = {
    "int8": lambda: quantize_int8(randn(40, 96, seed=1)),
    "int4": lambda: quantize_int4(randn(40, 96, seed=2)),
    "q8-g16": lambda: random_q8(40, 96, 16, mins=False, low=-32, high=32),
    "q8-g32-mins": lambda: random_q8(40, 96, 32, mins=True, low=0, high=32),
    "q8-g16-mins": lambda: random_q8(40, 96, 16, mins=True),
    "q4-0": lambda: QuantWeight(
        "q4",
        torch.randint(0, 16, (40, 96), dtype=torch.uint8),
        torch.rand(40, 3) * 0.1,
        -8 * torch.rand(40, 3) * 0.1,
        32,
    ),
    "q5-0": lambda: random_q5(-16),
    "q5-mins": lambda: random_q5(None),
    "mxfp4": lambda: random_mxfp4(40, 96),
}


def random_mxfp4(n: int, k: int, exponents: tuple[int, int] = (118, 131)) -> QuantWeight:
    """E2M1 codes and E8M0 scales (gpu_worker.mxfp4's checkpoint bytes); group 0 has the
    subnormal scales of E8M0 0 and 1 (rows 0 and 1)."""
    generator = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    e = torch.randint(*exponents, (n, k // 32), generator=generator, dtype=torch.uint8)
    e[:2, 0] = torch.tensor([0, 1])
    return QuantWeight("mxfp4", codes, e8m0_scales(e), None, 32)


def random_q5(min_scales: int | None) -> QuantWeight:
    """Codes 0..31; min = min_scales x scale, or mins of their own."""
    generator = torch.Generator().manual_seed(5)
    values = torch.randint(0, 32, (40, 96), generator=generator, dtype=torch.uint8)
    scales = torch.rand(40, 3, generator=generator) * 0.1
    mins = torch.randn(40, 3, generator=generator) * 0.1 if min_scales is None else None
    return QuantWeight("q5", values, scales, min_scales * scales if mins is None else mins, 32)


def native_linear(weight: QuantWeight, native, bias=None, dtype=torch.float32) -> QuantLinear:
    return QuantLinear([weight], bias, native=native, dtype=dtype, sizes=(1,))


def test_activations_quantize_alike_in_cpp_and_torch(native):
    x = randn(7, 96, seed=3)
    x[2, 32:64] = 0  # a group of zeros: scale 0, codes 0
    q, scales, sums = native.quantize_activations(x)
    codes, want_scales, want_sums = quantize_activations(x)
    assert torch.equal(q.float(), codes)
    assert torch.equal(scales, want_scales)
    assert torch.equal(sums.float(), want_sums)
    assert codes.abs().max() == 127


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_gives_the_references_bits(native, name, dtype):
    weight = FORMATS[name]()
    bias = randn(40, seed=4)
    x = randn(13, 96, seed=5).to(dtype)
    got = native_linear(weight, native, bias, dtype).kernel(x)
    assert got.dtype == dtype
    assert torch.equal(got, reference_matmul(x, weight, bias))


@pytest.mark.parametrize("name", list(FORMATS))
def test_reference_is_the_dequantized_product_within_the_activations_rounding(name):
    weight = FORMATS[name]()
    x = randn(9, 96, seed=6)
    exact = x.double() @ weight.dequantize().double().T
    # Each activation is off by at most half its group's step, max|x| / 254.
    step = x.view(9, -1, 32).abs().amax(-1).repeat_interleave(32, dim=1) / 254
    bound = step.double() @ weight.dequantize().double().abs().T
    error = (reference_matmul(x, weight).double() - exact).abs()
    assert (error <= bound * 1.001 + 1e-4).all()


@pytest.mark.parametrize("quantizer", [quantize_int8, quantize_int4])
def test_quantizers_round_each_weight_within_half_a_step(quantizer):
    w = randn(24, 64, seed=7)
    weight = quantizer(w)
    step = weight.scales.repeat_interleave(32, dim=1)
    assert ((weight.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("name", ["int8", "int4", "q8-g16-mins", "q5-0", "q5-mins", "mxfp4"])
def test_packing_keeps_every_value_and_row(name):
    weight = FORMATS[name]()
    packed = pack(weight)
    unpacked = packed.unpack()
    assert torch.equal(unpacked.values, weight.values)
    assert torch.equal(unpacked.scales, weight.scales)
    assert (unpacked.mins is None) == (weight.mins is None)
    ids = torch.tensor([[0, 39], [17, 16]])
    assert torch.equal(packed.dequantized_rows(ids), weight.dequantize()[ids])


@pytest.mark.parametrize("name", ["int8", "int4", "q8-g16", "q5-mins", "mxfp4"])
def test_a_rows_bits_do_not_depend_on_its_company(native, name):
    """A probe row alone, and at several positions among 1, 2, 5, 64 and 200 rows (register
    tiles of 8 rows, and their rests), gives the same bits."""
    linear = native_linear(FORMATS[name](), native, dtype=torch.bfloat16)
    probe = randn(1, 96, seed=8).bfloat16()
    alone = linear.kernel(probe)
    for rows in (2, 5, 64, 200):
        others = randn(rows, 96, seed=rows).bfloat16()
        for position in {0, rows // 2, rows - 1, min(rows - 1, 8)}:
            batch = others.clone()
            batch[position] = probe[0]
            assert torch.equal(linear.kernel(batch)[position], alone[0]), (rows, position)


def test_parts_of_different_formats_serve_one_fused_weight(native):
    """q and k in q4, v in q8 (a Q4_K_M file's Q6_K v): one call, outputs side by side."""
    q_part, v_part = FORMATS["int4"](), FORMATS["q8-g16"]()
    k_part = q_part.rows(0, 16)
    bias = randn(96, seed=9)
    x = randn(6, 96, seed=10)
    fused = QuantLinear([q_part, k_part, v_part], bias, native=native, dtype=torch.float32)
    separate = [
        reference_matmul(x, part, b)
        for part, b in ((q_part, bias[:40]), (k_part, bias[40:56]), (v_part, bias[56:]))
    ]
    assert len(fused.packed) == 2  # q and k merged: one format
    assert torch.equal(fused(x), torch.cat(separate, dim=1))


def test_the_reference_serves_without_the_kernel():
    weight = FORMATS["int4"]()
    x = randn(3, 96, seed=11)
    linear = QuantLinear([weight], native=None, dtype=torch.float32)
    assert torch.equal(linear(x), reference_matmul(x, weight))
    ids = torch.tensor([[1, 2]])
    assert torch.equal(linear.dequantized_rows(ids), weight.dequantize()[ids])


# gpt-oss's experts (gpu_worker.mxfp4): a partial column block, K of 1 and of 5 groups
@pytest.mark.parametrize("n, k", [(16, 32), (72, 160), (9, 64)])
@pytest.mark.parametrize("rows", [1, 7, 64, 67])
def test_the_mxfp4_kernel_gives_the_references_bits(native, n, k, rows):
    weight = random_mxfp4(n, k)
    bias = randn(n, seed=12)
    x = randn(rows, k, seed=rows).bfloat16()
    got = native_linear(weight, native, bias, torch.bfloat16).kernel(x)
    assert torch.equal(got, reference_matmul(x, weight, bias))


def test_mxfp4_rounds_each_groups_exact_product_once():
    """What is exact: each group's term is the float64 product of the dequantized weights
    and the int8-quantized activations, rounded once to float32; the reference sums those
    terms in float32 in K order, and so stays within float32's summation of the exact
    product."""
    weight = random_mxfp4(24, 160, exponents=(100, 150))
    x = randn(5, 160, seed=13)
    codes, scales, _ = quantize_activations(x)
    quantized = codes.double() * scales.double().repeat_interleave(32, dim=1)
    w = weight.dequantize().double()
    terms = torch.einsum("mgk,ngk->gmn", quantized.view(5, 5, 32), w.view(24, 5, 32)).float()
    summed = torch.zeros(5, 24)
    for term in terms:
        summed = summed + term
    got = reference_matmul(x, weight)
    assert torch.equal(got, summed)
    exact = quantized @ w.T
    bound = 5 * torch.finfo(torch.float32).eps * terms.double().abs().sum(0)
    assert ((got.double() - exact).abs() <= bound).all()
