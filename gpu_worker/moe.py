"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): top-k softmax routing and the
routed experts, exactly as transformers computes them.

A router (a Linear) scores each token's experts; softmax in float32, the top k kept
(renormalized to sum to one where the config says so: always for Mixtral,
norm_topk_prob for Qwen), and the token's output is the weighted sum of those experts'
gated MLPs. The tokens are grouped by expert with one sort, so the work is a loop over the
experts that were chosen (index_select in, index_add out), never over tokens.

A row's result does not depend on its company: every expert matmul is a Linear (fixed
call sizes, gpu_worker.linear), softmax and top-k work row by row, and each row's expert
outputs are added in the order of the experts, whichever other rows chose them. The
per-expert token counts are read on the host, so a mixture-of-experts step cannot be
captured in a CUDA graph (gpu_worker.graphs runs such models eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.linear import Linear
from gpu_worker.model_config import ModelConfig, MoE
from gpu_worker.weights import WeightTaker

Activation = Callable[[torch.Tensor], torch.Tensor]  # gate_up [T, 2I] -> [T, I]


@dataclass(slots=True)
class MoEMLP:
    router: Linear  # [experts, hidden]
    experts: list[tuple[Linear, Linear]]  # each expert's (gate_up, down)
    config: MoE
    shared: tuple[Linear, Linear] | None = None  # Qwen2-MoE's shared expert
    shared_gate: Linear | None = None  # [1, hidden]: sigmoid of it scales the shared expert

    def __call__(self, h: torch.Tensor, act_and_mul: Activation) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]."""
        cfg = self.config
        probs = torch.softmax(self.router(h), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not cfg.float32_weights:
            weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        # (token, slot) pairs grouped by expert, tokens ascending within each.
        order = torch.argsort(chosen.reshape(-1), stable=True)
        counts = torch.bincount(chosen.reshape(-1), minlength=cfg.num_experts).tolist()
        flat_weights = weights.reshape(-1)
        start = 0
        for (gate_up, down), count in zip(self.experts, counts, strict=True):
            if count:
                pairs = order[start : start + count]
                tokens = pairs // cfg.top_k
                y = down(act_and_mul(gate_up(h.index_select(0, tokens))))
                out.index_add_(0, tokens, (y * flat_weights[pairs, None]).to(out.dtype))
                start += count
        if self.shared is not None and self.shared_gate is not None:
            gate_up, down = self.shared
            shared = down(act_and_mul(gate_up(h)))
            # In float64, where a vectorized sigmoid and its scalar tail (which rows get
            # which depends on the step's row count) agree once rounded back.
            gate = torch.sigmoid(self.shared_gate(h).double()).to(h.dtype)
            out = out + gate * shared
        return out


def load_moe(take: WeightTaker, cfg: ModelConfig, prefix: str) -> MoEMLP:
    moe, hidden = cfg.moe, cfg.hidden_size
    assert moe is not None
    inter = moe.intermediate_size
    if cfg.family.moe == "mixtral":
        block = prefix + "block_sparse_moe."
        names = [
            tuple(f"{block}experts.{e}.w{i}" for i in (1, 3, 2)) for e in range(moe.num_experts)
        ]
    else:
        block = prefix + "mlp."
        names = [
            tuple(f"{block}experts.{e}.{p}_proj" for p in ("gate", "up", "down"))
            for e in range(moe.num_experts)
        ]
    mlp = MoEMLP(
        router=take.linear(block + "gate", (moe.num_experts, hidden)),
        experts=[take.gated_mlp(n, hidden, inter) for n in names],
        config=moe,
    )
    if moe.shared_intermediate_size:
        shared = tuple(f"{block}shared_expert.{p}_proj" for p in ("gate", "up", "down"))
        mlp.shared = take.gated_mlp(shared, hidden, moe.shared_intermediate_size)
        mlp.shared_gate = take.linear(block + "shared_expert_gate", (1, hidden))
    return mlp
