"""8-bit KV caches (int8, fp8 e4m3) in the C++ kernels, against the PyTorch reference
gpu_worker.kv_quant: the cache write quantizes exactly as the reference does, and attention on
an 8-bit cache gives the bits it gives on the cache of the model dtype holding the dequantized
values."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import native
from gpu_worker.kv_quant import KV_CACHE_DTYPES, dequantize, is_quantized, quantize_rows
from tests.test_worker_native import random_decode_case, random_prefill_case
from tests.worker_fixtures import needs_bf16_prefill_kernel

CACHE_DTYPES = list(KV_CACHE_DTYPES.values())
MODEL_DTYPES = [torch.float32, torch.bfloat16]
LIMITS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@pytest.fixture(scope="module")
def kernels():
    found = native.kernels()
    assert found is not None  # the suite's machines have a compiler and ninja
    return found


def bits(codes: torch.Tensor) -> torch.Tensor:
    """The codes' bytes: fp8 tensors cannot be compared directly, and -0 must differ from 0."""
    return codes.view(torch.uint8)


def assert_same_codes(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype
    assert torch.equal(bits(got), bits(expected))


def spread_rows(rows: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal rows whose magnitudes span 1e-3 .. 1e3, as keys and values of real layers do."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = 10 ** (torch.rand(rows, 1, generator=generator) * 6 - 3)
    return (torch.randn(rows, d, generator=generator) * magnitudes).to(dtype)


# ---- the reference ----------------------------------------------------------------------


def test_kv_cache_dtypes_and_is_quantized():
    assert set(KV_CACHE_DTYPES) == {"int8", "fp8"}
    assert is_quantized(torch.zeros(2, dtype=torch.int8))
    assert is_quantized(torch.zeros(2, dtype=torch.float8_e4m3fn))
    assert not is_quantized(torch.zeros(2, dtype=torch.bfloat16))
    assert not is_quantized(torch.zeros(2, dtype=torch.uint8))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=list(KV_CACHE_DTYPES))
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=["f32", "bf16"])
def test_scale_maps_each_rows_amax_to_the_largest_code(cache_dtype, dtype):
    x = spread_rows(50, 64, dtype, seed=1)
    codes, scales = quantize_rows(x, cache_dtype)
    assert codes.dtype == cache_dtype and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (50,)
    assert torch.equal(scales, x.float().abs().amax(dim=-1) / LIMITS[cache_dtype])
    assert torch.equal(codes.float().abs().amax(dim=-1), torch.full((50,), LIMITS[cache_dtype]))


@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=["f32", "bf16"])
def test_int8_round_trip_is_within_half_a_step(dtype):
    x = spread_rows(200, 128, dtype, seed=2)
    codes, scales = quantize_rows(x, torch.int8)
    exact = dequantize(codes, scales, torch.float32)
    step = scales.unsqueeze(-1)
    # Half a step, plus the float32 roundings of x / scale and of code * scale.
    assert ((x.float() - exact).abs() <= step * (0.5 + 1e-5)).all()
    # Rounding to the model dtype adds at most half its ulp.
    seen = dequantize(codes, scales, dtype)
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    assert ((seen.float() - exact).abs() <= exact.abs() * ulp).all()
    assert ((x.float() - exact).abs() > step * 0.4).any()  # the bound is not trivially loose


@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=["f32", "bf16"])
def test_fp8_round_trip_keeps_three_mantissa_bits(dtype):
    x = spread_rows(200, 128, dtype, seed=3)
    codes, scales = quantize_rows(x, torch.float8_e4m3fn)
    exact = dequantize(codes, scales, torch.float32)
    error = (x.float() - exact).abs()
    # Half an ulp of a 3-bit mantissa (2^-4 relative) for normal codes; subnormal codes (below
    # 2^-6) are multiples of 2^-9, so off by at most 2^-10 steps of the scale.
    bound = torch.maximum(x.float().abs() * 2.0**-4, scales.unsqueeze(-1) * 2.0**-10)
    assert (error <= bound * (1 + 1e-5)).all()
    assert (error > x.float().abs() * 2.0**-5).any()  # the bound is not trivially loose
    seen = dequantize(codes, scales, dtype)
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    assert ((seen.float() - exact).abs() <= exact.abs() * ulp).all()


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=list(KV_CACHE_DTYPES))
def test_zero_rows_get_zero_scales_and_zero_codes(cache_dtype):
    x = spread_rows(4, 32, torch.bfloat16, seed=4)
    x[1] = 0.0
    x[3] = -0.0  # no -0 codes either: the row's bytes are all 0
    codes, scales = quantize_rows(x, cache_dtype)
    assert scales[1] == 0 and scales[3] == 0 and (scales[[0, 2]] > 0).all()
    assert (bits(codes[[1, 3]]) == 0).all()
    assert not dequantize(codes, scales, torch.bfloat16)[[1, 3]].isnan().any()


def test_int8_rounds_half_to_even():
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -126.5]])  # scale 1
    codes, scales = quantize_rows(x, torch.int8)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [[127, 2, 4, -2, 0, 0, 2, -126]]


# ---- the cache write --------------------------------------------------------------------


def rope_write_case(dtype: torch.dtype, head_dim: int, seed: int):
    """qkv rows, random rope tables, and (kv_heads, blocks, block_size) caches' shape."""
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, tokens, positions_total = 6, 2, 11, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    # Rows of very different sizes, as real keys are: every quantization range is used.
    qkv = qkv * 10 ** (torch.rand(tokens, 1, generator=generator) * 4 - 2)
    angles = torch.rand(positions_total, head_dim // 2, generator=generator) * 6.3
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype)
    positions = torch.randperm(positions_total, generator=generator)[:tokens]
    slots = torch.randperm(36, generator=generator)[:tokens]  # 9 blocks of 4 slots per head
    return qkv.to(dtype), positions, cos, signed_sin, slots, heads, kv_heads, (kv_heads, 9, 4)


def written_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows at flat `slots` of every kv head: [kv_heads, len(slots), ...]."""
    return cache.flatten(1, 2)[:, slots]


def random_codes(shape: tuple[int, ...], cache_dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every code but fp8's NaNs (0x7f, 0xff) comes up, subnormal fp8 ones included."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32)
    if cache_dtype == torch.float8_e4m3fn:
        raw = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw)
    return raw.to(torch.uint8).view(cache_dtype)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=list(KV_CACHE_DTYPES))
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the scalar tail
def test_rope_and_cache_writes_the_references_codes(kernels, cache_dtype, dtype, head_dim):
    qkv, positions, cos, sin, slots, heads, kv_heads, scale_shape = rope_write_case(
        dtype, head_dim, seed=head_dim
    )
    shape = (*scale_shape, head_dim)
    plain_qkv = qkv.clone()
    plain_k, plain_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    kernels.rope_and_cache_(
        plain_qkv, positions, cos, sin, plain_k, plain_v, slots, heads, kv_heads
    )

    codes = [random_codes(shape, cache_dtype, seed=s) for s in (1, 2)]
    scales = [torch.full(scale_shape, -1.0) for _ in range(2)]
    quant_qkv, before = qkv.clone(), [c.clone() for c in codes]
    kernels.rope_and_cache_(quant_qkv, positions, cos, sin, *codes, slots, heads, kv_heads, *scales)

    assert torch.equal(quant_qkv, plain_qkv)  # q and k rotated in place as with a plain cache
    assert not torch.equal(quant_qkv, qkv)
    for plain, got_codes, got_scales, old in zip(
        (plain_k, plain_v), codes, scales, before, strict=True
    ):
        ref_codes, ref_scales = quantize_rows(written_rows(plain, slots), cache_dtype)
        assert_same_codes(written_rows(got_codes, slots), ref_codes)
        assert torch.equal(written_rows(got_scales, slots), ref_scales)
        # Nothing else is written.
        untouched = torch.ones(scale_shape[0], scale_shape[1] * scale_shape[2], dtype=torch.bool)
        untouched[:, slots] = False
        assert torch.equal(
            bits(got_codes.flatten(1, 2)[untouched]), bits(old.flatten(1, 2)[untouched])
        )
        assert (got_scales.flatten(1, 2)[untouched] == -1).all()


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=list(KV_CACHE_DTYPES))
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=["f32", "bf16"])
def test_rope_and_cache_quantizes_edge_rows_as_the_reference(kernels, cache_dtype, dtype):
    # Identity rope tables (cos 1, sin 0) store the k and v rows exactly as given.
    head_dim, heads, kv_heads = 32, 1, 1
    special = [
        torch.zeros(head_dim),  # scale 0
        torch.full((head_dim,), -0.0),
        torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -126.5] * 4),  # int8 ties
        torch.tensor(
            [448.0, 0.0625 * 9, -1.0 * 17 / 16, 1e-3, 2.0**-9, 3 * 2.0**-10, -7.0, 6.5] * 4
        ),
        torch.full((head_dim,), 3.0e38) * torch.linspace(-1, 1, head_dim),  # near float's max
        torch.full((head_dim,), 1e-37) * torch.linspace(-1, 1, head_dim),  # tiny scales
        torch.randn(head_dim, generator=torch.Generator().manual_seed(5)),
    ]
    tokens = len(special) // 2 + 1
    rows = torch.stack(special + special[:1])
    k, v = rows[:tokens], rows[tokens : 2 * tokens]
    q = torch.ones(tokens, heads * head_dim)
    qkv = torch.cat([q, k, v], dim=1).to(dtype)
    cos, sin = torch.ones(1, head_dim, dtype=dtype), torch.zeros(1, head_dim, dtype=dtype)
    positions, slots = torch.zeros(tokens, dtype=torch.long), torch.arange(tokens)
    shape = (kv_heads, 2, 4, head_dim)
    k_codes, v_codes = (torch.zeros(shape, dtype=cache_dtype) for _ in range(2))
    k_scales, v_scales = (torch.zeros(shape[:3]) for _ in range(2))
    kernels.rope_and_cache_(
        qkv, positions, cos, sin, k_codes, v_codes, slots, heads, kv_heads, k_scales, v_scales
    )
    for written, codes, scales in ((k, k_codes, k_scales), (v, v_codes, v_scales)):
        ref_codes, ref_scales = quantize_rows(written.to(dtype), cache_dtype)
        assert_same_codes(written_rows(codes, slots)[0], ref_codes)
        assert torch.equal(written_rows(scales, slots)[0], ref_scales)


# ---- attention --------------------------------------------------------------------------


def random_scales(shape: tuple[int, ...], cache_dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Scales of O(1) values, some rows zero."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.rand(shape, generator=generator) * 2 / LIMITS[cache_dtype]
    scales[torch.rand(shape, generator=generator) < 0.05] = 0.0
    return scales


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=list(KV_CACHE_DTYPES))
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: the plain loops
@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", [0, 7])  # 7: a sliding window, from mid-block
def test_decode_on_8_bit_caches_is_decode_on_their_values(
    kernels, cache_dtype, dtype, head_dim, group_size, block_size, window
):
    q, k_cache, _, tables, lens = random_decode_case(
        dtype, head_dim, group_size, block_size, seed=head_dim + block_size
    )
    k_codes = random_codes(k_cache.shape, cache_dtype, seed=1)
    v_codes = random_codes(k_cache.shape, cache_dtype, seed=2)
    k_scales = random_scales(k_cache.shape[:3], cache_dtype, seed=3)
    v_scales = random_scales(k_cache.shape[:3], cache_dtype, seed=4)
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(
        q, k_codes, v_codes, tables, lens, scale, k_scales, v_scales, window
    )
    expected = kernels.paged_decode_attention(
        q,
        dequantize(k_codes, k_scales, dtype),
        dequantize(v_codes, v_scales, dtype),
        tables,
        lens,
        scale,
        window=window,
    )
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.equal(got, expected)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=list(KV_CACHE_DTYPES))
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_decode_reads_every_code_as_the_reference(kernels, cache_dtype, dtype, head_dim):
    # One token per sequence: its probability is exactly 1, so the output is its value row.
    rows = -(-256 // head_dim)
    codes = torch.arange(rows * head_dim).remainder(256).to(torch.uint8).view(cache_dtype)
    v_codes = codes.view(1, rows, 1, head_dim)
    k_codes = torch.zeros_like(v_codes)
    scales = torch.rand(1, rows, 1, generator=torch.Generator().manual_seed(0)) + 0.5
    scales[0, -1] = 3e36  # 2^8 times it overflows: the fp8 kernel must not fold 2^8 into it
    q = torch.zeros(rows, 1, head_dim, dtype=dtype)
    tables, lens = torch.arange(rows).view(rows, 1), torch.ones(rows, dtype=torch.long)
    got = kernels.paged_decode_attention(q, k_codes, v_codes, tables, lens, 1.0, scales, scales)
    expected = dequantize(v_codes, scales, dtype).view(rows, 1, head_dim)
    nan = expected.isnan()
    assert nan.sum() == (2 * rows * head_dim // 256 if cache_dtype == torch.float8_e4m3fn else 0)
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], expected[~nan])


def quantized_prefill_case(num_queries, start, group_size, head_dim, block_size, cache_dtype):
    q, _, _, k_cache, v_cache, chunk = random_prefill_case(
        num_queries, start, group_size, head_dim, block_size, seed=num_queries + start
    )
    return (
        q,
        chunk.block_table,
        *quantize_rows(k_cache, cache_dtype),
        *quantize_rows(v_cache, cache_dtype),
    )


PREFILL_CASES = [
    (1, 0, 3, 64, 16),
    (37, 3, 3, 64, 16),  # an odd context
    (100, 0, 1, 64, 16),  # several query blocks from the start
    (64, 50, 3, 128, 16),  # mid-sequence
    (33, 17, 3, 32, 5),  # blocks of 5 tokens
]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=list(KV_CACHE_DTYPES))
@pytest.mark.parametrize(
    ("num_queries", "start", "group_size", "head_dim", "block_size"), PREFILL_CASES
)
@needs_bf16_prefill_kernel
def test_prefill_on_8_bit_caches_is_prefill_on_their_values_and_decode(
    kernels, cache_dtype, num_queries, start, group_size, head_dim, block_size
):
    q, table, k_codes, k_scales, v_codes, v_scales = quantized_prefill_case(
        num_queries, start, group_size, head_dim, block_size, cache_dtype
    )
    scale = head_dim**-0.5
    got = kernels.paged_prefill_attention(
        q, k_codes, v_codes, table, start, scale, k_scales, v_scales
    )
    k_values = dequantize(k_codes, k_scales, torch.bfloat16)
    v_values = dequantize(v_codes, v_scales, torch.bfloat16)
    expected = kernels.paged_prefill_attention(q, k_values, v_values, table, start, scale)
    assert torch.equal(got, expected)
    # Each row as the decode kernel computes its token on the same 8-bit caches.
    tables = table.expand(num_queries, -1)
    lens = torch.arange(start + 1, start + num_queries + 1)
    decoded = kernels.paged_decode_attention(
        q, k_codes, v_codes, tables, lens, scale, k_scales, v_scales
    )
    assert torch.equal(got, decoded)


# ---- bad inputs -------------------------------------------------------------------------


@pytest.fixture()
def int8_decode_case():
    q, k_cache, _, tables, lens = random_decode_case(torch.bfloat16, 64, 3, 16, seed=0)
    codes = random_codes(k_cache.shape, torch.int8, seed=1)
    return q, codes, codes.clone(), tables, lens, random_scales(codes.shape[:3], torch.int8, 2)


def test_decode_needs_the_scales_of_an_8_bit_cache(kernels, int8_decode_case):
    q, k_codes, v_codes, tables, lens, scales = int8_decode_case
    with pytest.raises(
        RuntimeError, match=r"k_cache is Char: its scales k_scales .* must be given"
    ):
        kernels.paged_decode_attention(q, k_codes, v_codes, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match=r"v_scales .* must be given"):
        kernels.paged_decode_attention(q, k_codes, v_codes, tables, lens, 0.125, scales)


@pytest.mark.parametrize(
    "bad",
    [
        lambda s: s[:, :-1],  # too few blocks
        lambda s: s.unsqueeze(-1),  # one more dim
        lambda s: s.double(),
        lambda s: s.transpose(1, 2).contiguous().transpose(1, 2),  # not contiguous
    ],
)
def test_decode_rejects_bad_scales(kernels, int8_decode_case, bad):
    q, k_codes, v_codes, tables, lens, scales = int8_decode_case
    with pytest.raises(RuntimeError, match="v_scales must be a contiguous float32 CPU tensor"):
        kernels.paged_decode_attention(
            q, k_codes, v_codes, tables, lens, 0.125, scales, bad(scales)
        )


def test_decode_rejects_scales_for_a_plain_cache(kernels, int8_decode_case):
    q, k_codes, _, tables, lens, scales = int8_decode_case
    plain = torch.zeros(k_codes.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="k_scales given, but k_cache is BFloat16"):
        kernels.paged_decode_attention(q, plain, plain, tables, lens, 0.125, scales, scales)
    with pytest.raises(RuntimeError, match="caches must share a dtype"):
        kernels.paged_decode_attention(q, k_codes, plain, tables, lens, 0.125, scales)


@needs_bf16_prefill_kernel
def test_prefill_needs_the_scales_of_an_8_bit_cache(kernels):
    q, table, k_codes, k_scales, v_codes, _ = quantized_prefill_case(
        5, 3, 3, 64, 16, torch.float8_e4m3fn
    )
    with pytest.raises(RuntimeError, match="v_cache is Float8_e4m3fn: its scales v_scales"):
        kernels.paged_prefill_attention(q, k_codes, v_codes, table, 3, 0.125, k_scales)
    with pytest.raises(RuntimeError, match="k_scales must be a contiguous float32"):
        kernels.paged_prefill_attention(
            q, k_codes, v_codes, table, 3, 0.125, k_scales[:1], k_scales
        )


def test_rope_and_cache_needs_the_scales_of_an_8_bit_cache(kernels):
    qkv, positions, cos, sin, slots, heads, kv_heads, scale_shape = rope_write_case(
        torch.bfloat16, 64, seed=0
    )
    codes = torch.zeros((*scale_shape, 64), dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"k_scales .* must be given"):
        kernels.rope_and_cache_(
            qkv, positions, cos, sin, codes, codes.clone(), slots, heads, kv_heads
        )
    scales = torch.zeros(scale_shape)
    with pytest.raises(RuntimeError, match="v_scales must be a contiguous float32"):
        kernels.rope_and_cache_(
            qkv,
            positions,
            cos,
            sin,
            codes,
            codes.clone(),
            slots,
            heads,
            kv_heads,
            scales,
            scales[..., :2],
        )
    assert (codes == 0).all()  # checked before anything is written
