"""The default model (SmolLM2-135M-Instruct) through the worker's ModelRunner.

The cache is $CADENCE_CACHE when set (a warm cache makes this quick), else a session-wide
temporary directory (a full fetch and conversion).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gpu_worker.protocol import WorkerConfig
from gpu_worker.runner import ModelRunner
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer
from tests.worker_fixtures import Chunk, make_plan, max_diff

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    explicit = os.environ.get("CADENCE_CACHE")
    cache = Path(explicit) if explicit else tmp_path_factory.mktemp("cadence-cache")
    return resolve_model(None, cache)


def runner_for(model_dir: Path, dtype: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    config = WorkerConfig(
        model_dir=str(model_dir),
        dtype=dtype,
        device="cpu",
        kv_memory=float(1 << 28),
        kv_cache_dtype=kv_cache_dtype,
    )
    return ModelRunner(config)


def chat_prompt(model_dir: Path, question: str) -> list[int]:
    tokenizer = Tokenizer.from_dir(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text)


def greedy(runner: ModelRunner, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """Prefill in chunks of 16 (so chunking is part of the path), then decode."""
    table = list(range(-(-(len(prompt) + max_tokens) // runner.cache.block_size)))
    for start in range(0, len(prompt), 16):
        piece = prompt[start : start + 16]
        result = runner.execute(make_plan([Chunk(0, piece, start, table)]))
    tokens = list(result.tokens)
    while len(tokens) < max_tokens and tokens[-1] not in eos:
        position = len(prompt) + len(tokens) - 1
        result = runner.execute(make_plan([Chunk(0, [tokens[-1]], position, table)]))
        assert result.error is None, result.error
        tokens += result.tokens
    return tokens


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "int8"), ("bfloat16", "fp8")],
)
def test_the_default_model_knows_the_capital_of_france(default_model_dir, dtype, kv_cache_dtype):
    runner = runner_for(default_model_dir, dtype, kv_cache_dtype)
    prompt = chat_prompt(default_model_dir, "What is the capital of France?")
    answer = Tokenizer.from_dir(default_model_dir).decode(
        greedy(runner, prompt, 32, set(Tokenizer.from_dir(default_model_dir).eos_token_ids))
    )
    print(f"\n{dtype}, {kv_cache_dtype} cache: {answer!r}")
    assert "Paris" in answer


def test_real_weights_match_transformers(default_model_dir):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    runner = runner_for(default_model_dir, "float32")
    prompt = chat_prompt(default_model_dir, "Write one sentence about the sea.")
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0, -1]
        generated = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    table = list(range(-(-(len(prompt) + 40) // runner.cache.block_size)))
    logits = runner.step_logits(make_plan([Chunk(1, prompt, 0, table)]))[0]
    assert max_diff(logits, reference) < 1e-4 * reference.abs().max().item()
    assert greedy(runner, prompt, 32, eos=set()) == generated


def test_bfloat16_logits_track_transformers_in_bfloat16(default_model_dir):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16).eval()
    runner = runner_for(default_model_dir, "bfloat16")
    prompt = chat_prompt(default_model_dir, "What is the capital of France?")
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0, -1].float()
    table = list(range(-(-len(prompt) // runner.cache.block_size)))
    logits = runner.step_logits(make_plan([Chunk(0, prompt, 0, table)]))[0]
    print(f"\nbfloat16 max |logit difference| vs transformers: {max_diff(logits, reference):.3f}")
    assert max_diff(logits, reference) < 0.05 * reference.abs().max().item()
    assert int(logits.argmax()) == int(reference.argmax())
