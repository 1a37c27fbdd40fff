"""Tiny random Hugging Face models and plan helpers for the worker tests (the fixtures are
registered in tests/conftest.py; a module that wants one torch thread says
`pytestmark = pytest.mark.usefixtures("one_torch_thread")`);
steps are planned with the device check's own records (ops.worker_steps.Seq, plan_of)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker import native, runtime
from gpu_worker.protocol import SamplingSpec, StepPlan, StepResult, WorkerConfig
from gpu_worker.runner import ModelRunner
from ops.worker_steps import Seq as Chunk
from ops.worker_steps import plan_of as make_plan  # noqa: F401  (standalone plans, for the tests)
from ops.worker_steps import steps_for
from service.config import default_cache_dir

VOCAB = 256
# The bfloat16 chunk (prefill) attention kernel, csrc/paged_prefill_attention.cpp, is built
# for CPUs with AVX512-BF16 only: elsewhere the worker never offers it (its other backends
# serve bfloat16 there, tested as everywhere), so its own tests have no kernel to run. The
# same holds for CUDA's tests on a machine without a GPU.
HAS_BF16_PREFILL_KERNEL = "avx512_bf16" in native.cpu_flags().split()
needs_bf16_prefill_kernel = pytest.mark.skipif(
    not HAS_BF16_PREFILL_KERNEL,
    reason="the bfloat16 prefill kernel is built only for CPUs with AVX512-BF16",
)
BLOCK_SIZE = 4  # small, so short test prompts already span several blocks
GREEDY = SamplingSpec()


LINEAR = {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
QWEN_EXPERTS = {
    "num_experts": 5,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
# The families beyond Llama and Qwen2: transformers' config and model class names, and what
# each tiny model sets beyond the common sizes. Windows are smaller than the test prompts;
# the mixtures route each token to several experts.
ARCHITECTURE_KINDS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 11}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": 11,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 3.0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": 11, "query_pre_attn_scalar": 24},
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "original_max_position_embeddings": 48,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
            "pad_token_id": 0,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 5, "num_experts_per_tok": 2, "sliding_window": 13},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    # Layer 1 without RoPE (NoPE), as every 4th layer of SmolLM3 3B.
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1], "pad_token_id": 0},
    ),
    # Windowed and global layers with head_dims and RoPEs of their own (proportional on the
    # global ones; their values the keys' projection, one k/v head),
    # per-layer inputs, the last two layers reading the first two's K/V with double-wide
    # MLPs, and the final soft-capping.
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "global_head_dim": 32,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "sliding_window": 11,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.5,
                    "rope_theta": 1e6,
                },
            },
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
            "final_logit_softcapping": 3.0,
        },
    ),
    # Three Gated DeltaNet layers to one gated full-attention layer (the real pattern),
    # two value heads per key head, partial rotary (a quarter of each head: transformers'
    # default); Qwen3-Next dense (no experts) and with experts and a shared expert.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**LINEAR, "num_experts": 0}),
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**LINEAR, **QWEN_EXPERTS}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", LINEAR),
    # (Qwen3.5-MoE's config has no intermediate_size: every layer is a mixture of experts)
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**LINEAR, **QWEN_EXPERTS, "intermediate_size": None},
    ),
    # A windowed layer and a full one, attention sinks, yarn RoPE, and a SwiGLU limit low
    # enough that its clamps bite.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 11,
            "num_local_experts": 5,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "swiglu_limit": 1.0,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        },
    ),
}


def save_tiny_model(path: Path, kind: str = "llama", **overrides) -> Path:
    """A 2-layer GQA model with random weights, saved as a Hugging Face directory."""
    import transformers
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
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    if kind in ARCHITECTURE_KINDS:
        config_name, model_name, settings = ARCHITECTURE_KINDS[kind]
        classes[kind] = (getattr(transformers, config_name), getattr(transformers, model_name))
        common.update(settings)
    common.update(overrides)
    config_cls, model_cls = classes[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common)).eval()
    # Random init leaves biases at zero and norms at one (Gemma's at zero), which would not
    # test them (the Llama and Qwen2 models keep their norms, as they always had).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif "norm" in name and kind in ARCHITECTURE_KINDS:
                param.uniform_(-0.5, 0.5).add_(0.0 if kind.startswith("gemma") else 1.0)
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's, ones
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's, saved with the weights
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    # Eager attention: the one that soft-caps Gemma 2's scores.
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture
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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """tiny_models(kind, **overrides) -> a saved tiny model of that kind, made once per
    session (kinds: llama, qwen2 and those of ARCHITECTURE_KINDS)."""
    made: dict[str, Path] = {}

    def tiny_model(kind: str, **overrides) -> Path:
        key = repr((kind, sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny_{kind}")
            made[key] = save_tiny_model(path, kind, **overrides)
        return made[key]

    return tiny_model


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


def plan_for(runner: ModelRunner, seqs: list[Chunk], step_id: int = 0) -> StepPlan:
    """The step of `seqs` on `runner`'s cache, with a table for each of its KV groups, as
    the service would send it after the plans sent to `runner` before."""
    return steps_for(runner).plan(seqs, step_id)


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
    result = runner.execute(plan_for(runner, [Chunk(seq_id, prompt, 0, table)]))
    tokens += sampled(result)
    for _ in range(steps - 1):
        position = len(prompt) + len(tokens) - 1
        result = runner.execute(plan_for(runner, [Chunk(seq_id, [tokens[-1]], position, table)]))
        tokens += sampled(result)
    return tokens


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
