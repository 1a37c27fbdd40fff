"""FlexAttention compiled through Triton on a CUDA device, against the PyTorch reference on
the same cache, by the chooser's own check; and its offer there."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import kernels
from gpu_worker.attention import FlexAttention, TorchAttention
from gpu_worker.kernel_choice import (
    Shapes,
    attention_case,
    check_attention,
    run_decode,
    run_prefill,
)

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("start", "chunk"), [(0, 300), (700, 512), (2500, 200)])
def test_compiled_flex_attention_matches_the_reference(block_size, dtype, start, chunk):
    # Grouped-query attention, 3 query heads per key/value head, head_dim 64; 32 decode
    # rows of ragged contexts over shuffled tables, and a chunk at a cached offset.
    shapes = Shapes(24, 8, 64, 1536, 4096, block_size, dtype, CUDA, dtype)
    case = attention_case(shapes, batch=32, chunk=chunk, start=start)
    reference = TorchAttention()
    expected = run_decode(reference, case), run_prefill(reference, case)
    assert check_attention(FlexAttention(), case, expected) is None


def test_flex_attention_is_offered_on_cuda():
    names = [c.name for c in kernels.attention_candidates(CUDA, torch.bfloat16, 64)]
    assert names == ["torch", "flex", "triton"]


@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize("chunk", [2, 17, 33, 64, 127])
def test_short_chunks_of_power_of_two_groups_compile_and_match(group, chunk):
    """Inductor's flex-decoding lowering takes no config for these (BLOCK_M = next_pow2(
    chunk * group) > 128 or not dividing it): a chunk forces the main kernel."""
    shapes = Shapes(8 * group, 8, 64, 1536, 4096, 64, torch.bfloat16, CUDA, torch.bfloat16)
    case = attention_case(shapes, batch=4, chunk=chunk, start=100)
    reference = TorchAttention()
    expected = run_decode(reference, case), run_prefill(reference, case)
    assert check_attention(FlexAttention(), case, expected) is None
