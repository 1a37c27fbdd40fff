"""--kv-cache-dtype int8|fp8: the cache's size, the model's outputs through it with every
kernel that can read it, and what it costs the default model's answers."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import kv_cache
from gpu_worker.kv_quant import KV_CACHE_DTYPES, quantize_rows
from gpu_worker.model_config import ModelConfig
from ops import kv_accuracy
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model
from tests.worker_fixtures import (
    HAS_BF16_PREFILL_KERNEL,
    Chunk,
    blocks_for,
    make_plan,
    make_runner,
    max_diff,
    random_prompt,
    save_tiny_model,
)

EIGHT_BIT = ["int8", "fp8"]
HEAD_DIM = 32  # the native chunk kernel takes multiples of 32


@pytest.fixture(scope="module")
def wide_heads_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("wide_heads"), head_dim=HEAD_DIM)


def test_cache_dtype_names():
    assert kv_cache.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache.cache_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    assert kv_cache.cache_dtype("int8", torch.float32) == torch.int8
    assert kv_cache.cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(kv_cache.KVCacheError, match="the model's dtype \\(float32\\)"):
        kv_cache.cache_dtype("bfloat16", torch.float32)


def test_an_8bit_block_takes_68_of_the_128_bytes_a_bfloat16_row_takes():
    model_dir = resolve_model(None, default_cache_dir())
    config = ModelConfig.from_dir(model_dir)
    bf16 = kv_cache.block_bytes(config, 16, torch.bfloat16)
    assert bf16 == 2 * 30 * 16 * 3 * 64 * 2
    for dtype in KV_CACHE_DTYPES.values():
        assert kv_cache.block_bytes(config, 16, dtype) * 128 == bf16 * 68


@pytest.mark.parametrize("cache", EIGHT_BIT)
def test_a_runner_holds_1_9x_the_blocks_in_the_same_memory(tiny_llama_dir, cache):
    budget = dict(kv_memory=float(1 << 20), max_num_seqs=10_000, dtype="bfloat16")
    plain = make_runner(tiny_llama_dir, **budget)
    quantized = make_runner(tiny_llama_dir, kv_cache_dtype=cache, **budget)
    assert quantized.handshake.kv_cache_dtype == str(KV_CACHE_DTYPES[cache]).removeprefix("torch.")
    # The tiny model's blocks: 2 layers, K and V, 2 kv heads, 4 slots of rows of 16 dims:
    # 32 bytes a row, or 16 + 4. The scratch block counts against the budget.
    assert plain.handshake.num_blocks + 1 == (1 << 20) // (2 * 2 * 2 * 4 * 32)
    assert quantized.handshake.num_blocks + 1 == (1 << 20) // (2 * 2 * 2 * 4 * 20)
    assert quantized.handshake.kv_bytes <= 1 << 20


KERNELS = [
    ("float32", "attention=torch,layer_ops=torch"),
    ("float32", "attention=native-rows,layer_ops=native"),
    ("bfloat16", "attention=torch,layer_ops=torch"),
    ("bfloat16", "attention=native-rows,layer_ops=native"),
    # the chunk kernel, where this CPU has it (tests.worker_fixtures)
    *([("bfloat16", "attention=native,layer_ops=native")] if HAS_BF16_PREFILL_KERNEL else []),
]


@pytest.mark.parametrize(("dtype", "kernels"), KERNELS)
@pytest.mark.parametrize("cache", EIGHT_BIT)
def test_prefill_and_decode_through_an_8bit_cache_stay_close(wide_heads_dir, dtype, kernels, cache):
    """The same steps with the model's dtype in the cache and with 8-bit codes: the cache
    holds exactly the quantized rows of what the model wrote, and the logits stay close."""
    plain = make_runner(wide_heads_dir, dtype=dtype, kernels=kernels)
    quantized = make_runner(wide_heads_dir, dtype=dtype, kernels=kernels, kv_cache_dtype=cache)
    prompt = random_prompt(45, seed=4)
    table = blocks_for(0, 60)
    logits = []
    for runner in (plain, quantized):
        runner.execute(make_plan([Chunk(0, prompt[:20], 0, table, sample=False)]))
        rows = [runner.step_logits(make_plan([Chunk(0, prompt[20:40], 20, table)]))[0]]
        for position in range(40, 45):  # decode steps
            rows.append(
                runner.step_logits(make_plan([Chunk(0, [prompt[position]], position, table)]))[0]
            )
        logits.append(torch.stack(rows))
    reference, got = logits
    error = max_diff(got, reference) / reference.abs().max().item()
    # This random model's logits spread wide (measured: int8 3.2-3.5 %, fp8 9.8-11.5 %).
    assert 0 < error < (0.05 if cache == "int8" else 0.15)
    # Layer 0's keys are computed before any attention, so they are the same rows in both.
    written = plain.cache.layers[0]
    codes = quantized.cache.layers[0]
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(45)])
    for plain_cache, cache_codes, cache_scales in (
        (written.k, codes.k, codes.k_scales),
        (written.v, codes.v, codes.v_scales),
    ):
        rows = plain_cache.view(plain_cache.shape[0], -1, HEAD_DIM)[:, slots]
        want_codes, want_scales = quantize_rows(rows, KV_CACHE_DTYPES[cache])
        got_codes = cache_codes.view(cache_codes.shape[0], -1, HEAD_DIM)[:, slots]
        assert torch.equal(got_codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(cache_scales.view(cache_scales.shape[0], -1)[:, slots], want_scales)


@pytest.fixture(scope="module")
def bfloat16_answers() -> list[kv_accuracy.Answer]:
    """Greedy answers of the default model on a bfloat16 cache, with their logits."""
    model_dir = resolve_model(None, default_cache_dir())
    reference = kv_accuracy.runner_for(model_dir, "bfloat16", "auto")
    return kv_accuracy.reference_answers(
        reference, kv_accuracy.prompts(model_dir, count_random=1), count=16
    )


@pytest.mark.real_model
@pytest.mark.parametrize("cache", EIGHT_BIT)
def test_the_default_model_keeps_its_greedy_answers_with_an_8bit_cache(cache, bfloat16_answers):
    """Teacher-forced over greedy bfloat16 answers (ops/kv_accuracy.py; BENCHMARKS.md has
    the full run): int8 and fp8 chose the reference's token at 98 % of positions there."""
    model_dir = resolve_model(None, default_cache_dir())
    quantized = kv_accuracy.runner_for(model_dir, "bfloat16", cache)
    result = kv_accuracy.compare(bfloat16_answers, quantized)
    assert result.positions == 16 * len(bfloat16_answers)
    assert result.rate >= 0.9
    assert 0 < result.mean_error < 0.06 and result.max_error < 0.2
