"""The C++ decode-attention kernel against the PyTorch decode path it replaces on CPU."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import attention, native


def test_the_kernel_builds_here() -> None:
    # The machines the suite runs on have a compiler and ninja (a dependency): a kernel that
    # does not build is a failure, not a reason to skip; the cause is in the log.
    assert native.kernels() is not None


def random_decode_case(
    dtype: torch.dtype, head_dim: int, group_size: int, block_size: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """q (a strided view, as the model passes it), caches, block tables and context lengths.

    Blocks are shuffled, so no table is contiguous; the last two rows are padding (the
    scratch block, context length 1), and one real row has a context of a single token.
    """
    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, width = 7, 2, 5
    heads = kv_heads * group_size
    num_blocks = batch * width
    scratch = num_blocks
    shape = (kv_heads, num_blocks + 1, block_size, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator).view(batch, width)
    lens = torch.randint(1, width * block_size + 1, (batch,), generator=generator)
    lens[0], lens[1] = 1, width * block_size
    tables[-2:], lens[-2:] = scratch, 1
    qk = torch.randn(batch, heads + kv_heads, head_dim, generator=generator).to(dtype)
    return qk[:, :heads], k_cache, v_cache, tables, lens


def decode_both_ways(q, k_cache, v_cache, tables, lens) -> tuple[torch.Tensor, torch.Tensor]:
    group_size = q.shape[1] // k_cache.shape[0]

    def run(use_native: bool) -> torch.Tensor:
        group = attention.decode_group(
            slice(None), tables, lens, k_cache, group_size, use_native=use_native
        )
        assert (group.gather is None) == use_native
        return attention._decode_attention(q, k_cache, v_cache, group)

    return run(True), run(False)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: the scalar loops
@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("block_size", [16, 5])  # 5: kernel steps of 4 rows straddle blocks
def test_kernel_matches_pytorch_decode(dtype, tolerance, head_dim, group_size, block_size):
    case = random_decode_case(dtype, head_dim, group_size, block_size, seed=head_dim + block_size)
    got, expected = decode_both_ways(*case)
    assert got.dtype == dtype and got.shape == case[0].shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_kernel_rejects_a_block_outside_the_cache():
    q, k_cache, v_cache, tables, lens = random_decode_case(torch.float32, 64, 3, 16, seed=0)
    tables[0, 0] = k_cache.shape[1]
    kernel = native.kernels().paged_decode_attention
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, k_cache, v_cache, tables, lens, 0.125)
