"""A decoder layer's tensors, taken from the checkpoint by their Hugging Face names.

One Layer record serves every family (gpu_worker.model_config.FAMILIES): the parts a
family lacks are None, and the model's forward pass skips them. q/k/v and gate/up are
fused into single matmuls at load (Phi-3's checkpoint holds them fused already), each
part leaving the checkpoint's dict as it is taken (see WeightTaker). Gemma's norm weights
are stored as 1 + w in float32, the form layer_ops.gemma_rms_norm takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker.linear import Linear
from gpu_worker.model_config import ModelConfig
from gpu_worker.moe import MoEMLP, load_moe


class MissingWeights(ValueError):
    """The checkpoint lacks tensors the architecture needs, or has the wrong shapes."""


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden], with Qwen2's biases
    o_proj: Linear
    mlp_norm: torch.Tensor  # before the MLP (Llama's post_attention_layernorm)
    gate_up: Linear | None  # [2 * intermediate, hidden]; None in a mixture-of-experts layer
    down: Linear | None
    cos: torch.Tensor  # the layer's RoPE tables (rope.rope_tables), shared with its kind
    signed_sin: torch.Tensor
    attention: int  # its KV group (gpu_worker.kv_groups), whose attention records it reads
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim]: q heads', then k's
    attn_out_norm: torch.Tensor | None = None  # Gemma's post_attention_layernorm
    mlp_out_norm: torch.Tensor | None = None  # Gemma's post_feedforward_layernorm
    moe: MoEMLP | None = None


class WeightTaker:
    """Takes tensors out of the checkpoint's dict by Hugging Face name, checks their shape,
    places them. A multimodal model's text weights are renamed as the text model's first.

    Taking removes each tensor from the dict, so once a layer's q/k/v (or gate/up) are
    fused, nothing holds the separate parts: loading peaks at the model plus one fused
    tensor rather than twice the fused weights.
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        prepack: bool,
        gemma_norms: bool = False,
        text_prefixes: tuple[str, ...] = (),
    ):
        for name in [n for n in weights if n.startswith(text_prefixes)]:
            prefix = next(p for p in text_prefixes if name.startswith(p))
            weights["model." + name.removeprefix(prefix)] = weights.pop(name)
        if "language_model.lm_head.weight" in weights:
            weights["lm_head.weight"] = weights.pop("language_model.lm_head.weight")
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.prepack = prepack
        self.gemma_norms = gemma_norms

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.weights.pop(name, None)
        if tensor is None:
            raise MissingWeights(f"checkpoint lacks the tensor {name}")
        if tuple(tensor.shape) != shape:
            raise MissingWeights(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(self.device, self.dtype).contiguous()

    def norm(self, name: str, size: int) -> torch.Tensor:
        """An RMSNorm's weight; Gemma's as 1 + w in float32."""
        if not self.gemma_norms:
            return self(name, (size,))
        weight = self.weights.get(name)
        self(name, (size,))  # checks and removes it
        assert weight is not None
        return (1.0 + weight.to(self.device, torch.float32)).contiguous()

    def fused(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        parts = [self(n, s) for n, s in zip(names, shapes, strict=True)]
        return torch.cat(parts).contiguous()

    def linear(self, name: str, shape: tuple[int, int]) -> Linear:
        return Linear(self(name + ".weight", shape), prepack=self.prepack)

    def gated_mlp(self, names: Sequence[str], hidden: int, inter: int) -> tuple[Linear, Linear]:
        """(gate_up, down) of a gated MLP whose gate, up and down weights are `names`."""
        gate, up, down = names
        gate_up = self.fused([gate + ".weight", up + ".weight"], [(inter, hidden)] * 2)
        return Linear(gate_up, prepack=self.prepack), self.linear(down, (hidden, inter))


def load_layer(
    take: WeightTaker,
    cfg: ModelConfig,
    index: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    kind: int,
) -> Layer:
    prefix = f"model.layers.{index}."
    hidden, head_dim, family = cfg.hidden_size, cfg.head_dim, cfg.family
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    attn = prefix + "self_attn."
    layer = Layer(
        input_norm=take.norm(prefix + "input_layernorm.weight", hidden),
        qkv=_qkv(take, cfg, attn),
        o_proj=take.linear(attn + "o_proj", (hidden, heads * head_dim)),
        mlp_norm=take.norm(
            prefix
            + ("pre_feedforward_layernorm" if family.gemma else "post_attention_layernorm")
            + ".weight",
            hidden,
        ),
        gate_up=None,
        down=None,
        cos=rope[0],
        signed_sin=rope[1],
        attention=kind,
    )
    if family.qk_norm:
        q_norm = take.norm(attn + "q_norm.weight", head_dim)
        k_norm = take.norm(attn + "k_norm.weight", head_dim)
        layer.qk_norm = torch.cat([q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)])
    if family.gemma:
        layer.attn_out_norm = take.norm(prefix + "post_attention_layernorm.weight", hidden)
        layer.mlp_out_norm = take.norm(prefix + "post_feedforward_layernorm.weight", hidden)
    if cfg.moe is not None and cfg.moe.sparse_layers[index]:
        layer.moe = load_moe(take, cfg, prefix)
    elif family.fused_projections:
        inter = cfg.intermediate_size
        layer.gate_up = take.linear(prefix + "mlp.gate_up_proj", (2 * inter, hidden))
        layer.down = take.linear(prefix + "mlp.down_proj", (hidden, inter))
    else:
        mlp = prefix + "mlp."
        names = (mlp + "gate_proj", mlp + "up_proj", mlp + "down_proj")
        layer.gate_up, layer.down = take.gated_mlp(names, hidden, cfg.intermediate_size)
    return layer


def _qkv(take: WeightTaker, cfg: ModelConfig, attn: str) -> Linear:
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_attention_heads * head_dim
    kv_rows = cfg.num_key_value_heads * head_dim
    qkv_rows = [q_rows, kv_rows, kv_rows]
    if cfg.family.fused_projections:
        return take.linear(attn + "qkv_proj", (sum(qkv_rows), hidden))
    qkv_names = [f"{attn}{p}_proj" for p in ("q", "k", "v")]
    qkv_bias = None
    if cfg.attention_bias:
        qkv_bias = take.fused([n + ".bias" for n in qkv_names], [(r,) for r in qkv_rows])
    qkv_weight = take.fused([n + ".weight" for n in qkv_names], [(r, hidden) for r in qkv_rows])
    return Linear(qkv_weight, qkv_bias, prepack=take.prepack)
