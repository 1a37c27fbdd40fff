"""`cadence bench roofline`: the floor arithmetic on the default model's shapes, and the
command end to end (its measurements are printed, never asserted)."""

from __future__ import annotations

import pytest

from gpu_worker.model_config import ModelConfig
from ops.roofline import Machine, ModelCost, decode_floor, main, w1_floor
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model

SMOLLM2_MATMUL_PARAMS = 134_479_872  # 30 layers of q, k, v, o and the MLP, plus the tied head


SMOLLM2_CONFIG = {  # the default model's config.json, the fields the cost reads
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def cost() -> ModelCost:
    return ModelCost.of(ModelConfig.from_dict(SMOLLM2_CONFIG))


@pytest.mark.real_model
def test_the_config_above_is_the_default_models() -> None:
    real = ModelConfig.from_dir(resolve_model(None, default_cache_dir()))
    assert ModelCost.of(real) == ModelCost.of(ModelConfig.from_dict(SMOLLM2_CONFIG))


def test_the_model_cost_counts_every_matmul_weight_once(cost: ModelCost) -> None:
    assert cost.weight_bytes == 2 * SMOLLM2_MATMUL_PARAMS
    assert cost.flops_per_token == 2 * SMOLLM2_MATMUL_PARAMS
    assert cost.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # K and V, 3 kv heads of 64, bf16


def test_a_decode_step_is_bound_by_bytes_or_by_flops_whichever_is_slower(cost) -> None:
    slow_memory = Machine(bandwidth=1e9, matmul_flops=1e18)
    moved = cost.weight_bytes + 64 * 320 * cost.kv_bytes_per_token
    assert decode_floor(cost, slow_memory, 64, 320) == pytest.approx(moved / 1e9)
    slow_math = Machine(bandwidth=1e18, matmul_flops=1e12)
    flops = 64 * cost.flops_per_token + 64 * 320 * cost.attention_flops_per_pair
    assert decode_floor(cost, slow_math, 64, 320) == pytest.approx(flops / 1e12)


def test_w1_is_its_prefill_and_127_decode_steps(cost) -> None:
    machine = Machine(bandwidth=1e18, matmul_flops=1e12)  # flops only: easy to add up
    prefill = 64 * 256 * cost.flops_per_token + 64 * 256 * 257 // 2 * cost.attention_flops_per_pair
    decodes = sum(
        64 * cost.flops_per_token + 64 * (256 + t) * cost.attention_flops_per_pair
        for t in range(1, 128)
    )
    assert w1_floor(cost, machine) == pytest.approx((prefill + decodes) / 1e12)


@pytest.mark.real_model
def test_the_command_prints_the_floors_and_the_fraction(capsys) -> None:
    argv = ["--copy-megabytes", "8", "--matmul-size", "128", "--measured-step-ms", "100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "GB/s" in out and "TFLOP/s" in out
    assert "of the floor's speed" in out and "out tok/s" in out
