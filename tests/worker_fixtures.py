"""Tiny random Hugging Face models and plan helpers for the worker tests (import explicitly);
steps are planned with the GPU smoke run's own records (ops.gpu_smoke.Seq, plan_of)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker import runtime
from gpu_worker.protocol import SamplingSpec, StepResult, WorkerConfig
from gpu_worker.runner import ModelRunner
from ops.gpu_smoke import Seq as Chunk
from ops.gpu_smoke import plan_of as make_plan
from service.config import default_cache_dir

VOCAB = 256
BLOCK_SIZE = 4  # small, so short test prompts already span several blocks
GREEDY = SamplingSpec()


def save_tiny_model(path: Path, kind: str = "llama", **overrides) -> Path:
    """A 2-layer GQA model with random weights, saved as a Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        # Larger than the default 0.02 so logits spread out and greedy choices are clear.
        initializer_range=0.15,
        eos_token_id=2,
        bos_token_id=1,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common)).eval()
    if kind == "qwen2":  # random init leaves biases at zero, which would not test them
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a busy machine every parallel
    region waits for both threads to be scheduled (50 ms steps instead of 0.3 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def make_runner(model_dir: Path, **overrides) -> ModelRunner:
    settings = dict(
        model_dir=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_memory=float(2 * 1024 * 1024),
        max_num_seqs=16,
        seed=0,
        kernel_cache=str(default_cache_dir() / "kernels.json"),
    )
    settings.update(overrides)
    return runtime.start(WorkerConfig(**settings))


def sampled(result: StepResult) -> list[int]:
    """The token each sampled sequence took, from a step that samples one each."""
    assert result.error is None, result.error
    assert all(len(row) == 1 for row in result.tokens), result.tokens
    return [row[0] for row in result.tokens]


def blocks_for(first_block: int, num_tokens: int) -> list[int]:
    """Consecutive block ids from first_block, enough for num_tokens tokens."""
    return list(range(first_block, first_block + -(-num_tokens // BLOCK_SIZE)))


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def generate_greedy(
    runner: ModelRunner, prompt: list[int], steps: int, seq_id: int = 0
) -> list[int]:
    """Prefill the whole prompt, then decode `steps - 1` tokens, one step each."""
    table = blocks_for(0, len(prompt) + steps)
    tokens: list[int] = []
    result = runner.execute(make_plan([Chunk(seq_id, prompt, 0, table)]))
    tokens += sampled(result)
    for _ in range(steps - 1):
        position = len(prompt) + len(tokens) - 1
        result = runner.execute(make_plan([Chunk(seq_id, [tokens[-1]], position, table)]))
        tokens += sampled(result)
    return tokens


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
