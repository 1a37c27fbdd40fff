"""A hybrid model's KV groups on a CUDA device: decode steps captured as CUDA graphs read
each group's block tables (gpu_worker.graphs pads them per group) and continue greedy
decoding as the CPU worker does, past the windows of the tiny Gemma 3's local layers."""

from __future__ import annotations

import pytest

from tests.worker_fixtures import generate_greedy, make_runner, random_prompt

pytestmark = pytest.mark.cuda


def test_captured_decode_steps_of_a_hybrid_model_decode_as_the_cpu_does(tiny_models):
    path = tiny_models("gemma3")  # a full group and two windowed ones (window 11)
    cpu = make_runner(path)
    gpu = make_runner(path, device="cuda", use_cuda_graphs=True)
    assert gpu.limits.num_groups == 3 and gpu.handshake.graphs["captured"] > 0
    prompt = random_prompt(30, seed=3)
    assert generate_greedy(gpu, prompt, steps=24) == generate_greedy(cpu, prompt, steps=24)
    assert not gpu.decode_runner.failed
