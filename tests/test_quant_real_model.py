"""The default model with its weights kept quantized keeps most of its greedy answers
(ops/weight_accuracy.py measures the same on more prompts and tokens)."""

from __future__ import annotations

import pytest

from ops import kv_accuracy
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model

pytestmark = pytest.mark.real_model

TOKENS = 16


@pytest.fixture(scope="module")
def bfloat16_answers() -> list[kv_accuracy.Answer]:
    """Greedy answers of the default model with dense bfloat16 weights, with their logits."""
    model_dir = resolve_model(None, default_cache_dir())
    reference = kv_accuracy.runner_for(model_dir, "bfloat16", "auto")
    prompts = kv_accuracy.prompts(model_dir, count_random=1)
    return kv_accuracy.reference_answers(reference, prompts, count=TOKENS)


# The full run (7 prompts, 48 tokens) measured int8 98 %, int4 90 %, gguf 98 % agreement
# and mean errors of 3.7 %, 12.5 %, 3.4 %; gguf's reference is the file dequantized, so
# only the activations' rounding separates them.
@pytest.mark.parametrize(
    "quantization, agreement, mean_error",
    [("int8", 0.9, 0.06), ("gguf", 0.9, 0.06), ("int4", 0.75, 0.2)],
)
def test_the_default_model_keeps_its_greedy_answers_quantized(
    bfloat16_answers, quantization, agreement, mean_error
):
    model_dir = resolve_model(None, default_cache_dir())
    runner = kv_accuracy.runner_for(model_dir, "bfloat16", "auto", quantization)
    assert runner.handshake.quantization == f"{quantization} (native kernel)"
    result = kv_accuracy.compare(bfloat16_answers, runner)
    assert result.positions == TOKENS * len(bfloat16_answers)
    assert result.rate >= agreement
    assert 0 < result.mean_error < mean_error
