"""A model served with its weights quantized (--quantization int8 / int4): close to the dense
model, and as exact as it in the one sense the server promises: a token's logits are the
same bits whether its row is prefilled in a chunk of any size or decoded beside others."""

from __future__ import annotations

import argparse

import pytest
import torch

from gpu_worker import runtime
from gpu_worker.quant import QuantLinear
from gpu_worker.runner import ModelRunner
from service.cli import add_serve_args, config_from_args
from service.engine.worker_link import worker_config_for
from tests.worker_fixtures import Chunk, blocks_for, make_runner, plan_for, random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTH = 23


def logits_decoded(runner: ModelRunner, tokens: list[int], prompt: int) -> torch.Tensor:
    """The logits after each of tokens[prompt - 1:], the prompt in one chunk, then one
    token per step beside another sequence's decode rows."""
    table, other = blocks_for(0, len(tokens)), blocks_for(20, 2 * len(tokens))
    company = random_prompt(len(tokens), seed=9)
    rows = [runner.step_logits(plan_for(runner, [Chunk(0, tokens[:prompt], 0, table)]))[0]]
    runner.step_logits(plan_for(runner, [Chunk(1, company[:prompt], 0, other)]))
    for position in range(prompt, len(tokens)):
        step = [
            Chunk(1, [company[position]], position, other),
            Chunk(0, [tokens[position]], position, table),
        ]
        rows.append(runner.step_logits(plan_for(runner, step))[1])
    return torch.stack(rows)


def logits_chunked(runner: ModelRunner, tokens: list[int], chunk: int) -> dict[int, torch.Tensor]:
    """The logits at the last row of each prefill chunk, by position."""
    table, found = blocks_for(40, len(tokens)), {}
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        logits = runner.step_logits(plan_for(runner, [Chunk(0, part, start, table)]))[0]
        found[start + len(part) - 1] = logits
    return found


@pytest.fixture(scope="module")
def dense(tiny_llama_dir) -> ModelRunner:
    return make_runner(tiny_llama_dir)


# A random tiny model's logits lie close together: int4 flips many near-ties.
@pytest.mark.parametrize("quantization, bound, agreement", [("int8", 0.1, 0.8), ("int4", 0.6, 0.5)])
def test_quantized_logits_stay_close_to_the_dense_models(
    dense, tiny_llama_dir, quantization, bound, agreement
):
    runner = make_runner(tiny_llama_dir, quantization=quantization)
    layer = runner.model.layers[0]
    assert isinstance(layer.qkv, QuantLinear) and isinstance(layer.down, QuantLinear)
    assert isinstance(runner.model.lm_head, QuantLinear)
    assert runner.handshake.quantization == f"{quantization} (native kernel)"
    tokens = random_prompt(LENGTH, seed=3)
    want, got = logits_decoded(dense, tokens, 9), logits_decoded(runner, tokens, 9)
    scale = want.abs().amax(-1, keepdim=True)
    error = ((got - want).abs() / scale).max().item()
    assert 0 < error < bound  # quantized, and not by more than its rounding
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= agreement


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_chunked_prefill_gives_the_decoded_bits(tiny_llama_dir, quantization):
    runner = make_runner(tiny_llama_dir, dtype="bfloat16", quantization=quantization)
    tokens = random_prompt(LENGTH, seed=4)
    decoded = logits_decoded(runner, tokens, 5)
    for chunk in (1, 3, 8, LENGTH):
        for position, logits in logits_chunked(runner, tokens, chunk).items():
            if position >= 4:
                assert torch.equal(logits, decoded[position - 4]), (chunk, position)


def test_the_refined_logits_use_the_served_head_rows(tiny_llama_dir):
    """In bfloat16 the top logits are recomputed in float32 from the LM head's rows: a
    quantized head's dequantized rows, never the dense embedding's."""
    runner = make_runner(tiny_llama_dir, dtype="bfloat16", quantization="int4")
    model = runner.model
    assert isinstance(model.lm_head, QuantLinear)
    h = torch.randn(2, model.config.hidden_size).bfloat16()
    top = torch.tensor([[1, 5], [7, 200]])
    served = model.lm_head.dequantized_rows(top).double()
    want = (served * h.double().unsqueeze(1)).sum(-1).float()
    assert torch.equal(model._exact_logits(h, top), want)
    dense = (model.embed[top].double() * h.double().unsqueeze(1)).sum(-1).float()
    assert not torch.equal(want, dense)


def test_qwen2s_biases_are_added_to_the_quantized_qkv(tiny_models):
    model_dir = tiny_models("qwen2")
    dense, runner = make_runner(model_dir), make_runner(model_dir, quantization="int8")
    qkv = runner.model.layers[0].qkv
    assert isinstance(qkv, QuantLinear) and qkv.biases[0] is not None
    tokens = random_prompt(LENGTH, seed=5)
    want, got = logits_decoded(dense, tokens, 9), logits_decoded(runner, tokens, 9)
    assert ((got - want).abs() / want.abs().amax(-1, keepdim=True)).max() < 0.1


def test_the_flag_reaches_the_worker():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = config_from_args(parser.parse_args(["--quantization", "int4"]))
    assert worker_config_for(config, "/models/x").quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


def test_the_reference_serves_the_same_bits_where_the_kernel_is_not_built(
    tiny_llama_dir, monkeypatch
):
    """The slow correct path (a CPU without AVX2, CUDA) computes what the kernel does."""
    native = make_runner(tiny_llama_dir, dtype="bfloat16", quantization="int4")
    monkeypatch.setattr(runtime, "quant_kernels", lambda device: None)
    reference = make_runner(tiny_llama_dir, dtype="bfloat16", quantization="int4")
    assert reference.handshake.quantization == "int4 (reference kernel)"
    tokens = random_prompt(LENGTH, seed=6)
    assert torch.equal(logits_decoded(reference, tokens, 7), logits_decoded(native, tokens, 7))
