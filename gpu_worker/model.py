"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over a paged KV cache.

One forward pass takes the flattened tokens of a whole mixed batch (prefill chunks and
decode tokens, [T] ids at [T] absolute positions) and returns hidden states [T, hidden];
the LM head runs separately, only on the rows that sample a token.

The layers are plain tensors rather than nn.Modules: a decode step is hundreds of small
kernels, and module call overhead would be a visible share of it on a CPU. Weights come in
with their Hugging Face names; q/k/v and gate/up are fused into single matmuls at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionMetadata, paged_attention
from gpu_worker.model_config import ModelConfig, RopeScaling

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class MissingWeights(ValueError):
    """The checkpoint lacks tensors the architecture needs, or has the wrong shapes."""


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]
    down_weight: torch.Tensor


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        take = _WeightTaker(weights, dtype, device)
        self.embed = take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        self.layers = [_load_layer(take, config, i) for i in range(config.num_hidden_layers)]
        self.norm = take("model.norm.weight", (config.hidden_size,))
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight", (config.vocab_size, config.hidden_size))
        self.cos, self.sin = rope_tables(config, max_positions, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        num_tokens = input_ids.shape[0]
        # Broadcast over heads; the rotation is applied to q and k heads in one go.
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            qk = qkv[:, : q_width + kv_width].view(num_tokens, heads + kv_heads, head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_width + kv_width :].view(num_tokens, kv_heads, head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)
            x = x + F.linear(attn, layer.o_weight)
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            x = x + F.linear(swiglu(F.linear(h, layer.gate_up_weight)), layer.down_weight)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the rows that sample: [S, hidden] -> float32 [S, vocab]."""
        h = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    @property
    def weight_bytes(self) -> int:
        tensors = {id(t): t for t in (self.embed, self.norm, self.lm_head)}
        for layer in self.layers:
            for name in Layer.__slots__:
                tensor = getattr(layer, name)
                if tensor is not None:
                    tensors[id(tensor)] = tensor
        return sum(t.numel() * t.element_size() for t in tensors.values())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused kernel (it normalises in float32, as transformers does) instead of six.
    return F.rms_norm(x, weight.shape, weight, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate_half convention: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_frequencies(inv_freq, scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Exactly transformers' _compute_llama3_parameters.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim], computed in float32 like transformers."""
    inv_freq = inverse_frequencies(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


class _WeightTaker:
    """Looks tensors up by Hugging Face name, checks their shape, places them."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.weights = weights
        self.dtype = dtype
        self.device = device

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.weights.get(name)
        if tensor is None:
            raise MissingWeights(f"checkpoint lacks the tensor {name}")
        if tuple(tensor.shape) != shape:
            raise MissingWeights(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(self.device, self.dtype).contiguous()

    def fused(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.cat([self(n, s) for n, s in zip(names, shapes, strict=True)]).contiguous()


def _load_layer(take: _WeightTaker, cfg: ModelConfig, index: int) -> Layer:
    prefix = f"model.layers.{index}."
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_attention_heads * head_dim
    kv_rows = cfg.num_key_value_heads * head_dim
    attn = prefix + "self_attn."
    qkv_names = [f"{attn}{p}_proj" for p in ("q", "k", "v")]
    qkv_rows = [q_rows, kv_rows, kv_rows]
    qkv_bias = None
    if cfg.attention_bias:
        qkv_bias = take.fused([n + ".bias" for n in qkv_names], [(r,) for r in qkv_rows])
    mlp = prefix + "mlp."
    inter = cfg.intermediate_size
    return Layer(
        input_norm=take(prefix + "input_layernorm.weight", (hidden,)),
        qkv_weight=take.fused([n + ".weight" for n in qkv_names], [(r, hidden) for r in qkv_rows]),
        qkv_bias=qkv_bias,
        o_weight=take(attn + "o_proj.weight", (hidden, q_rows)),
        post_norm=take(prefix + "post_attention_layernorm.weight", (hidden,)),
        gate_up_weight=take.fused(
            [mlp + "gate_proj.weight", mlp + "up_proj.weight"], [(inter, hidden), (inter, hidden)]
        ),
        down_weight=take(mlp + "down_proj.weight", (hidden, inter)),
    )
