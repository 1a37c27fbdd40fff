"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, gpt-oss,
Gemma 4): top-k softmax routing and the routed experts, exactly as transformers computes them.

A router (a Linear) scores each token's experts; softmax in float32, the top k kept
(renormalized to sum to one where the config says so: always for Mixtral,
norm_topk_prob for Qwen), and the token's output is the weighted sum of those experts'
gated MLPs. gpt-oss routes the other way round (the top k logits, then a softmax over
them, in the model's dtype), its router and experts have biases, and its experts apply a
clamped SwiGLU; its checkpoint holds each layer's experts stacked ([experts, in, out],
gate and up interleaved), split here into one (gate_up, down) pair of matmuls per expert:
Linears, or on the CPU, where the checkpoint holds them in MXFP4, QuantLinears of kind
mxfp4 (gpu_worker.mxfp4; the activations quantized to int8 per 32, as llama.cpp does).
Gemma 4's experts run beside its dense MLP (`beside_dense`): routed from the residual
stream (normed, scaled by a vector and by hidden ** -0.5), fed its own norm of it, their
weights renormalized and scaled per expert, and their sum normed before it joins the
dense MLP's normed output.
The tokens are grouped by expert with one sort, so the work is a loop over the experts
that were chosen (index_select in, index_add out), never over tokens.

A row's result does not depend on its company: every expert matmul is a Linear or a
QuantLinear (fixed call sizes, gpu_worker.linear), softmax and top-k work row by row, and
each row's expert outputs are added in the order of the experts, whichever other rows
chose them. The per-expert token counts are read on the host, so a mixture-of-experts step
cannot be captured in a CUDA graph (gpu_worker.graphs runs such models eagerly).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.linear import Linear
from gpu_worker.model_config import ModelConfig, MoE, SwiGLU
from gpu_worker.quant import Matmul, QuantLinear
from gpu_worker.weights import WeightTaker

Activation = Callable[[torch.Tensor], torch.Tensor]  # gate_up [T, 2I] -> [T, I]
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(slots=True)
class BesideDense:
    """Gemma 4's parts around experts that run beside the dense MLP."""

    router_norm: torch.Tensor  # [hidden] ones: an unscaled norm of the residual stream
    router_scale: torch.Tensor  # [hidden]
    router_scalar: float  # hidden ** -0.5
    expert_scale: torch.Tensor  # [experts]: each chosen expert's weight is scaled by its
    dense_out_norm: torch.Tensor  # post_feedforward_layernorm_1
    experts_in_norm: torch.Tensor  # pre_feedforward_layernorm_2
    experts_out_norm: torch.Tensor  # post_feedforward_layernorm_2


@dataclass(slots=True)
class MoEMLP:
    router: Linear  # [experts, hidden]
    experts: list[tuple[Matmul, Matmul]]  # each expert's (gate_up, down)
    config: MoE
    shared: tuple[Linear, Linear] | None = None  # Qwen2-MoE's shared expert
    shared_gate: Linear | None = None  # [1, hidden]: sigmoid of it scales the shared expert
    gemma4: BesideDense | None = None

    def __call__(
        self, h: torch.Tensor, act_and_mul: Activation, routed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; `routed`: what the router scores, where not h."""
        cfg = self.config
        weights, chosen = self._route(h if routed is None else routed)
        if cfg.swiglu is not None:
            act_and_mul = functools.partial(clamped_swiglu, cfg.swiglu)
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

    def beside_dense(
        self, x: torch.Tensor, dense: torch.Tensor, act_and_mul: Activation, norm: Norm, eps: float
    ) -> torch.Tensor:
        """Gemma 4: the dense MLP's output `dense` [T, hidden] joined by the experts' on
        the residual stream x [T, hidden] (before the MLP's norm)."""
        parts = self.gemma4
        assert parts is not None
        routed = norm(x, parts.router_norm, eps) * parts.router_scale * parts.router_scalar
        experts = self(norm(x, parts.experts_in_norm, eps), act_and_mul, routed)
        dense = norm(dense, parts.dense_out_norm, eps)
        return dense + norm(experts, parts.experts_out_norm, eps)

    def _route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts' weights and ids [T, top_k]."""
        cfg = self.config
        logits = self.router(h)
        if cfg.top_k_first:
            top, chosen = logits.topk(cfg.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), chosen
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.gemma4 is not None:
            weights = weights * self.gemma4.expert_scale[chosen]
        if not cfg.float32_weights:
            weights = weights.to(h.dtype)
        return weights, chosen


def clamped_swiglu(swiglu: SwiGLU, gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's activation of gate_up [T, 2I] (gate, then up) -> [T, I], in transformers'
    order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=swiglu.limit)
    up = up.clamp(min=-swiglu.limit, max=swiglu.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu.alpha))


def load_moe(take: WeightTaker, cfg: ModelConfig, prefix: str) -> MoEMLP:
    moe, hidden = cfg.moe, cfg.hidden_size
    assert moe is not None
    inter = moe.intermediate_size
    if cfg.family.moe == "gpt_oss":
        return _load_stacked_moe(take, moe, hidden, prefix + "mlp.")
    if cfg.family.moe == "gemma4":
        return _load_gemma4_moe(take, moe, hidden, prefix)
    if cfg.family.moe == "mixtral":
        block = prefix + "block_sparse_moe."
        names = [
            tuple(f"{block}experts.{e}.w{i}" for i in (1, 3, 2)) for e in range(moe.num_experts)
        ]
    else:
        block = prefix + "mlp."
        _unstack_experts(take.weights, block)
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


def _unstack_experts(weights: dict[str, torch.Tensor], block: str) -> None:
    """A checkpoint that stacks a layer's experts as transformers 5 holds them (gate_up_proj
    [experts, 2I, hidden]: gate, then up; down_proj [experts, hidden, I]) in the dict as
    each expert's gate_proj, up_proj and down_proj, the names the loader takes."""
    gate_up = weights.pop(block + "experts.gate_up_proj", None)
    down = weights.pop(block + "experts.down_proj", None)
    if gate_up is None or down is None:
        return
    for e in range(gate_up.shape[0]):  # the loader checks the count against the config
        gate, up = gate_up[e].chunk(2, dim=0)
        for name, tensor in (("gate", gate), ("up", up), ("down", down[e])):
            weights[f"{block}experts.{e}.{name}_proj.weight"] = tensor


def _load_stacked_moe(take: WeightTaker, moe: MoE, hidden: int, block: str) -> MoEMLP:
    """gpt-oss's experts: gate_up_proj [experts, hidden, 2I] (gate and up interleaved) and
    down_proj [experts, I, hidden], with biases, split into each expert's matmuls."""
    experts, inter = moe.num_experts, moe.intermediate_size
    experts_block = block + "experts."
    # Interleaved columns (gate, up, gate, ...) to the [gate | up] rows act_and_mul takes.
    gate_first = torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)])
    gate_ups = _expert_matmuls(
        take, experts_block + "gate_up_proj", (experts, hidden, 2 * inter), gate_first
    )
    downs = _expert_matmuls(take, experts_block + "down_proj", (experts, inter, hidden))
    router = Linear(
        take(block + "router.weight", (experts, hidden)),
        take(block + "router.bias", (experts,)),
        kernel=take.matmul_kernel,
    )
    return MoEMLP(router=router, experts=list(zip(gate_ups, downs, strict=True)), config=moe)


def _expert_matmuls(
    take: WeightTaker,
    name: str,
    shape: tuple[int, int, int],
    order: torch.Tensor | None = None,
) -> list[Matmul]:
    """Each expert's matmul of the stacked weight `name` ([experts, in, out]) and its bias,
    its output rows in `order` (None: as stored): kept in MXFP4 where the checkpoint has it
    so and the weights were read packed (on the CPU), else dense."""
    experts, _, out = shape
    rows = torch.arange(out) if order is None else order
    biases = take(name + "_bias", (experts, out))[:, rows.to(take.device)]
    quantized = take.mxfp4_experts(name, shape)
    if quantized is not None:
        return [
            QuantLinear([weight.select(rows)], bias, native=take.quant_kernels, dtype=take.dtype)
            for weight, bias in zip(quantized, biases, strict=True)
        ]
    stacked = take(name, shape)
    rows = rows.to(stacked.device)
    return [
        Linear(stacked[e].T[rows], biases[e], kernel=take.matmul_kernel) for e in range(experts)
    ]


def _load_gemma4_moe(take: WeightTaker, moe: MoE, hidden: int, prefix: str) -> MoEMLP:
    """Gemma 4's experts: gate_up_proj [experts, 2I, hidden] (gate, then up) and down_proj
    [experts, hidden, I], each expert's slices already in a Linear's layout."""
    experts, inter, kernel = moe.num_experts, moe.intermediate_size, take.matmul_kernel
    gate_up = take(prefix + "experts.gate_up_proj", (experts, 2 * inter, hidden))
    down = take(prefix + "experts.down_proj", (experts, hidden, inter))
    router = prefix + "router."
    parts = BesideDense(
        router_norm=torch.ones(hidden, dtype=torch.float32, device=take.device),
        router_scale=take(router + "scale", (hidden,)),
        router_scalar=hidden**-0.5,
        expert_scale=take(router + "per_expert_scale", (experts,)),
        dense_out_norm=take.norm(prefix + "post_feedforward_layernorm_1.weight", hidden),
        experts_in_norm=take.norm(prefix + "pre_feedforward_layernorm_2.weight", hidden),
        experts_out_norm=take.norm(prefix + "post_feedforward_layernorm_2.weight", hidden),
    )
    return MoEMLP(
        router=take.linear(router + "proj", (experts, hidden)),
        experts=[
            (Linear(gate_up[e].clone(), kernel=kernel), Linear(down[e].clone(), kernel=kernel))
            for e in range(experts)
        ],
        config=moe,
        gemma4=parts,
    )
