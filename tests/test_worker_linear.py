"""The model's matmuls give a row the same bits however many rows share its call.

gpu_worker.linear calls the library only with row counts it checked at load. Here: the
calls cover every row once in checked sizes; a kernel that sums some call sizes otherwise,
or a row by its position, has those sizes left out; and with such a kernel, as with this
machine's oneDNN and F.linear, every row's bits are the same at any row count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from gpu_worker import native
from gpu_worker.linear import ROW_SIZES, Linear, RowSizes, agreeing_sizes

DTYPES = [torch.bfloat16, torch.float32]


@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=12, unique=True).map(sorted),
    st.integers(0, 2000),
)
def test_the_calls_cover_each_row_once_in_checked_sizes(sizes, rows):
    calls = RowSizes(tuple(sizes)).calls(rows)
    assert [first for first, _, _ in calls] == list(range(0, rows, sizes[-1]))[: len(calls)]
    assert sum(count for _, count, _ in calls) == rows
    for _first, count, size in calls:
        assert size in sizes and count <= size
        smaller = [s for s in sizes if s < size]
        assert not smaller or count > max(smaller)  # the smallest size that holds them


def exact(x, weight):
    """A kernel whose rows never depend on their call: summed in float64, where the order
    of summation is lost in the rounding to float32."""
    return F.linear(x.double(), weight.double()).float()


def summed_otherwise(x, weight):
    return F.linear(x.flip(-1), weight.flip(-1))


def reordered_for(small: set[int]):
    """Calls of the `small` sizes sum each row's products in another order, as a library's
    kernel for narrow (or wide) calls may."""

    def kernel(x, weight):
        return (summed_otherwise if x.shape[0] in small else exact)(x, weight)

    return kernel


def last_row_nudged(x, weight):
    """A call's last row is summed otherwise (a kernel's row tail)."""
    y = exact(x, weight)
    if x.shape[0] > 1:
        y[-1] = summed_otherwise(x[-1:], weight)[0]
    return y


class FakeLibrary(Linear):
    """A Linear whose library kernel is `how` (weight passed in)."""

    __slots__ = ()
    how = staticmethod(F.linear)

    def kernel(self, x):
        return self.how(x, self.weight)


def fake_linear(how, weight, sizes=ROW_SIZES) -> Linear:
    kind = type("Fake", (FakeLibrary,), {"__slots__": (), "how": staticmethod(how)})
    return kind(weight, kernel="aten", sizes=sizes)


def weight_of(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype)


def test_sizes_whose_kernel_sums_otherwise_are_left_out():
    weight = weight_of(96, 576, torch.float32)
    found = agreeing_sizes(
        lambda x: reordered_for({1, 2, 3, 4, 5, 6, 7, 8})(x, weight), 576, ROW_SIZES, weight
    )
    assert found.sizes == tuple(s for s in ROW_SIZES if s > 8)
    # The other way round: the narrow class is the larger one.
    found = agreeing_sizes(
        lambda x: reordered_for({128, 160, 192, 224, 256})(x, weight), 576, ROW_SIZES, weight
    )
    assert found.sizes == tuple(s for s in ROW_SIZES if s < 128)


def test_sizes_whose_rows_depend_on_their_position_are_left_out():
    weight = weight_of(96, 576, torch.float32)
    found = agreeing_sizes(lambda x: last_row_nudged(x, weight), 576, ROW_SIZES, weight)
    assert found.sizes == (1,)


def split_between_threads(x, weight):
    """Wide calls on more than one thread sum each row in two halves, as a kernel that
    splits the reduction between threads does."""
    if x.shape[0] < 128 or torch.get_num_threads() == 1:
        return exact(x, weight)
    half = x.shape[1] // 2
    return exact(x[:, :half], weight[:, :half]) + exact(x[:, half:], weight[:, half:])


def test_sizes_whose_bits_change_with_the_thread_count_are_left_out():
    weight = weight_of(96, 576, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        found = agreeing_sizes(lambda x: split_between_threads(x, weight), 576, ROW_SIZES, weight)
    finally:
        torch.set_num_threads(threads)
    assert found.sizes == tuple(s for s in ROW_SIZES if s < 128)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_has_the_same_bits_on_one_thread(dtype):
    linear = Linear(weight_of(960, 576, dtype))
    rows = torch.randn(300, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    threads = torch.get_num_threads()
    many = linear(rows)
    torch.set_num_threads(1)
    try:
        assert torch.equal(linear(rows), many)
    finally:
        torch.set_num_threads(threads)


def row_bits_at_every_count(linear: Linear, in_features: int, dtype: torch.dtype) -> list[int]:
    """The row counts at which some row differs from itself computed alone."""
    generator = torch.Generator().manual_seed(9)
    rows = torch.randn(600, in_features, generator=generator).to(dtype)
    alone = torch.cat([linear(rows[i : i + 1]) for i in range(600)])
    counts = [*range(1, 70), 95, 96, 97, 255, 256, 257, 300, 513, 600]
    return [n for n in counts if not torch.equal(linear(rows[:n]), alone[:n])]


@pytest.mark.parametrize(
    "how", [reordered_for({2, 3, 4, 5, 6, 7, 8, 16, 17}), reordered_for({1}), last_row_nudged]
)
def test_a_row_has_its_bits_at_any_row_count_whatever_the_library_does(how):
    weight = weight_of(96, 64, torch.float32)
    assert row_bits_at_every_count(fake_linear(how, weight), 64, torch.float32) == []


# native takes bfloat16 weights only (it gives float32 ones to oneDNN)
KERNELS_BY_DTYPE = [
    (torch.bfloat16, "aten"),
    (torch.bfloat16, "onednn"),
    (torch.bfloat16, "native"),
    (torch.float32, "aten"),
    (torch.float32, "onednn"),
]


@pytest.mark.parametrize(
    ("dtype", "kernel"), KERNELS_BY_DTYPE, ids=[f"{d}-{k}" for d, k in KERNELS_BY_DTYPE]
)
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)])
def test_a_row_has_its_bits_at_any_row_count_on_this_machine(dtype, kernel, shape):
    linear = Linear(weight_of(*shape, dtype), kernel=kernel)
    assert row_bits_at_every_count(linear, shape[1], dtype) == []


def test_without_the_checked_sizes_the_fake_library_would_differ():
    """The fake kernels do change bits (else the tests above prove nothing)."""
    weight = weight_of(96, 64, torch.float32)
    rows = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    kernel = reordered_for({8})
    assert not torch.equal(kernel(rows, weight)[:1], kernel(rows[:1], weight))
    assert torch.equal(exact(rows, weight)[:1], exact(rows[:1], weight))
    assert not torch.equal(last_row_nudged(rows, weight)[-1:], last_row_nudged(rows[-1:], weight))


NATIVE_BF16 = hasattr(torch.ops.cadence, "bf16_matmul") or (
    native.kernels() is not None and hasattr(native.kernels(), "bf16_matmul")
)
needs_native_bf16 = pytest.mark.skipif(
    not NATIVE_BF16, reason="cadence's bfloat16 matmul is built on CPUs with AVX512-BF16"
)


@needs_native_bf16
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (1000, 64), (7, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_native_bf16_kernel_is_the_float32_product_rounded(
    out_features, in_features, with_bias
):
    """Columns past a block of 16 (1000, 7) are cut off; each output is the float32 sum
    of its products plus the bias, rounded once to bfloat16."""
    weight = weight_of(out_features, in_features, torch.bfloat16)
    generator = torch.Generator().manual_seed(4)
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    linear = Linear(weight, bias, kernel="native")
    assert linear.kind == "native"
    rows = torch.randn(37, in_features, generator=generator).bfloat16()
    got = linear(rows)
    want = F.linear(rows.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # one bfloat16 rounding (2^-8 relative) beyond float32's different order of summation
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3 * in_features**0.5)


@needs_native_bf16
def test_every_call_size_of_the_native_bf16_kernel_agrees():
    """It sums a row alike at every call size and position (oneDNN's sizes fall into
    classes on some CPUs)."""
    linear = Linear(weight_of(960, 576, torch.bfloat16), kernel="native")
    assert linear.row_sizes.sizes == ROW_SIZES


def test_the_native_kernel_gives_way_where_it_cannot_take_the_weight():
    """float32 weights go to oneDNN (or F.linear where oneDNN is missing)."""
    linear = Linear(weight_of(96, 64, torch.float32), kernel="native")
    assert linear.kind == ("onednn" if torch.backends.mkldnn.is_available() else "aten")


def rounded_to_bf16_in_halves_at(size: int):
    """Sums rounded to bfloat16 (summed in float64: no order shows), but in calls of
    `size` rows each half of a row's products is first rounded to float32, as a kernel
    that splits the reduction does: a change bfloat16's rounding hides in most outputs."""

    def kernel(x, weight):
        x, weight = x.double(), weight.double()
        if x.shape[0] != size:
            return F.linear(x, weight).bfloat16()
        half = x.shape[1] // 2
        first = F.linear(x[:, :half], weight[:, :half]).float()
        return (first + F.linear(x[:, half:], weight[:, half:]).float()).bfloat16()

    return kernel


def test_an_order_of_summation_that_bfloat16_hides_is_found_whatever_the_weight():
    """Random probe rows against a model-like weight miss it; the stand-in weight's
    cancelling probe rows (gpu_worker.linear) do not."""
    weight = weight_of(576, 1536, torch.bfloat16)
    kernel = rounded_to_bf16_in_halves_at(256)
    missed = agreeing_sizes(lambda x: kernel(x, weight), 1536, ROW_SIZES, weight)
    assert 256 in missed.sizes  # what the probe of the weight itself found
    linear = fake_linear(kernel, weight)
    assert 256 not in linear.row_sizes.sizes
    assert row_bits_at_every_count(linear, 1536, torch.bfloat16) == []
