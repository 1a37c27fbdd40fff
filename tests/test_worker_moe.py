"""The mixture-of-experts MLP (gpu_worker.moe) against transformers' sparse MoE blocks, on
routing skewed so that one expert takes most tokens and another none."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layer_ops import TorchLayerOps
from gpu_worker.linear import Linear
from gpu_worker.model_config import ModelConfig
from gpu_worker.moe import MoEMLP

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HIDDEN, EXPERTS, TOKENS = 32, 6, 50
# transformers' config class, block class, and what the config sets beyond the sizes
BLOCKS = {
    "mixtral": ("MixtralConfig", "MixtralSparseMoeBlock", {"num_local_experts": EXPERTS}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeSparseMoeBlock",
        {"num_experts": EXPERTS, "norm_topk_prob": True},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeSparseMoeBlock",
        {"num_experts": EXPERTS, "shared_expert_intermediate_size": 24},
    ),
}


def skewed_block(kind: str):
    """(transformers' block, its config as a dict, inputs): expert 0 scores high on most
    tokens, the last expert low on all."""
    import importlib

    import transformers

    config_name, block_name, settings = BLOCKS[kind]
    config = getattr(transformers, config_name)(
        hidden_size=HIDDEN,
        intermediate_size=16,
        moe_intermediate_size=16,
        num_experts_per_tok=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        **settings,
    )
    torch.manual_seed(0)
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    block = getattr(module, block_name)(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
        direction = torch.randn(HIDDEN)
        block.gate.weight[0] = 3 * direction
        block.gate.weight[-1] = -3 * direction
    h = torch.randn(TOKENS, HIDDEN) + direction
    return block, config.to_dict(), h


def our_mlp(kind: str, block, raw: dict) -> MoEMLP:
    raw = {**raw, "architectures": [BLOCKS[kind][1].replace("SparseMoeBlock", "ForCausalLM")]}
    raw["num_hidden_layers"], raw["vocab_size"] = 1, 16
    moe = ModelConfig.from_dict(raw).moe
    assert moe is not None
    experts = block.experts
    mlp = MoEMLP(
        Linear(block.gate.weight.detach()),
        [
            (Linear(experts.gate_up_proj[e].detach()), Linear(experts.down_proj[e].detach()))
            for e in range(EXPERTS)
        ],
        moe,
    )
    if moe.shared_intermediate_size:
        shared = block.shared_expert
        gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach()
        mlp.shared = (Linear(gate_up), Linear(shared.down_proj.weight.detach()))
        mlp.shared_gate = Linear(block.shared_expert_gate.weight.detach())
    return mlp


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_the_experts_mix_as_transformers_mixes_them(kind):
    block, raw, h = skewed_block(kind)
    mlp = our_mlp(kind, block, raw)
    chosen = torch.softmax(block.gate.weight @ h.T, dim=0).topk(3, dim=0).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
    assert counts[0] >= 0.8 * TOKENS and counts[-1] == 0  # uneven: one busy, one idle
    with torch.no_grad():
        expected = block(h[None])[0]
    act = TorchLayerOps().silu_and_mul
    got = mlp(h, act)
    assert (got - expected).abs().max() < 1e-5
    # Each row's bits are its own, whichever rows share its experts.
    assert torch.equal(torch.cat([mlp(h[i : i + 1], act) for i in range(TOKENS)]), got)
