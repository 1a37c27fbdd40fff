"""Mixed steps from CUDA graphs (gpu_worker.mixed_graphs), whole where the attention backend
attends from static records (TritonAttention), else piecewise: prompts prefilled in chunks
beside decoding rows give the greedy tokens and logits the eager worker gives."""

from __future__ import annotations

import pytest
import torch

from tests.worker_fixtures import Chunk, blocks_for, make_plan, make_runner, random_prompt

pytestmark = pytest.mark.cuda


def test_mixed_steps_from_graphs_match_the_eager_ones(tiny_llama_dir):
    graphed = make_runner(tiny_llama_dir, device="cuda", use_cuda_graphs=True)
    eager = make_runner(tiny_llama_dir, device="cuda", use_cuda_graphs=False)
    assert graphed.handshake.graphs["mixed"]["buckets"]
    assert not graphed.handshake.graphs["mixed"]["failed"]
    whole = graphed.model.kernels.attention.captures_steps
    assert graphed.handshake.graphs["mixed"]["whole"] == whole
    first, second = random_prompt(40, seed=1), random_prompt(25, seed=2)
    plans = [
        [Chunk(0, first[:30], 0, blocks_for(0, 41))],
        [Chunk(0, first[30:], 30, blocks_for(0, 41)), Chunk(1, second, 0, blocks_for(20, 26))],
        [Chunk(0, [5], 40, blocks_for(0, 41)), Chunk(2, random_prompt(9, 3), 0, [40, 41, 42])],
    ]
    for seqs in plans:
        got = graphed.step_logits(make_plan(seqs))
        want = eager.step_logits(make_plan(seqs))
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
