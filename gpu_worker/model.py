"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over a paged KV cache.

One forward pass takes the flattened tokens of a whole mixed batch (prefill chunks and
decode tokens, [T] ids at [T] absolute positions) and returns hidden states [T, hidden];
the LM head runs separately, only on the rows that sample a token.

The layers are plain tensors rather than nn.Modules: a decode step is hundreds of small
kernels, and module call overhead would be a visible share of it on a CPU. Weights come in
with their Hugging Face names; q/k/v and gate/up are fused into single matmuls at load,
each part leaving the checkpoint's dict as it is taken (see _WeightTaker).
Which kernels run the attention, the small layer ops and the matmuls is the worker's
choice (gpu_worker.kernels), made once before the model loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionMetadata, paged_attention
from gpu_worker.kernels import Kernels
from gpu_worker.kv_cache import LayerKV
from gpu_worker.linear import LM_HEAD_ROW_SIZES, Linear
from gpu_worker.model_config import ModelConfig, RopeScaling
from gpu_worker.sampler import Logits

REFINED_LOGITS = 8  # top logits per row recomputed in float32 when the model runs in bfloat16


class MissingWeights(ValueError):
    """The checkpoint lacks tensors the architecture needs, or has the wrong shapes."""


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden], with Qwen2's biases
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels: Kernels,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.kernels = kernels
        self.ops = kernels.layer_ops
        take = _WeightTaker(weights, dtype, device)
        self.embed = take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        prepack = kernels.matmul == "onednn"
        self.layers = [
            _load_layer(take, config, i, prepack) for i in range(config.num_hidden_layers)
        ]
        self.norm = take("model.norm.weight", (config.hidden_size,))
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            lm_head = self.embed
        else:
            lm_head = take("lm_head.weight", (config.vocab_size, config.hidden_size))
        self.lm_head = Linear(lm_head, prepack=prepack, sizes=LM_HEAD_ROW_SIZES)
        self.lm_head_rows = lm_head  # dense, for recomputing single logits
        self.cos, self.signed_sin = rope_tables(config, max_positions, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[T] token ids at [T] positions -> final-normed hidden states [T, hidden].

        Writes the tokens' K/V into their cache slots on the way.
        """
        cfg, ops, eps = self.config, self.ops, self.config.rms_norm_eps
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        num_tokens = input_ids.shape[0]
        # The residual stream, updated in place; each norm comes fused with the add before it.
        x = F.embedding(input_ids, self.embed)
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm, kv in zip(self.layers, next_norms, kv_caches, strict=True):
            qkv = layer.qkv(h)
            ops.rope_and_cache_(
                qkv,
                positions,
                self.cos,
                self.signed_sin,
                kv,
                meta.slots,
                heads,
                kv_heads,
            )
            q = qkv[:, :q_width].view(num_tokens, heads, head_dim)
            k = qkv[:, q_width : q_width + kv_width].view(num_tokens, kv_heads, head_dim)
            v = qkv[:, q_width + kv_width :].view(num_tokens, kv_heads, head_dim)
            attn = paged_attention(q, k, v, kv, meta)
            h = ops.add_rms_norm_(x, layer.o_proj(attn), layer.post_norm, eps)
            h = ops.add_rms_norm_(x, layer.down(ops.silu_and_mul(layer.gate_up(h))), next_norm, eps)
        return h

    def logits(self, h: torch.Tensor) -> Logits:
        """The LM head for the final-normed rows that sample: [S, hidden] -> [S, vocab].

        A bfloat16 logit keeps 8 bits of mantissa: around 25, values 0.125 apart collapse,
        so the best tokens often tie and greedy decoding would choose among them by token
        id (SmolLM2 then answers "L'Étoile" instead of "Paris"). The few highest logits of
        each row are therefore recomputed in float32 from the same hidden state.
        """
        logits = self.lm_head(h)
        if logits.dtype == torch.float32:
            return Logits(logits)
        top = self.ops.top_k_ids(logits, min(REFINED_LOGITS, logits.shape[1]))
        return Logits(logits, top, self._exact_logits(h, top))

    def _exact_logits(self, h: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """The logits of the `top` ids [S, k] of each row, in float32.

        Summed in float64, where the order of summation is lost in the rounding to float32:
        a library's matmul may sum a row otherwise by how many rows share the call, and a
        row's logits must not depend on its company.
        """
        rows = self.lm_head_rows[top].double()  # [S, k, hidden]
        return (rows * h.double().unsqueeze(1)).sum(-1).float()


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
    """cos and signed sin [max_positions, head_dim], computed in float32 like transformers.

    The signed sin is sin with its first half negated, the form layer_ops.apply_rope takes.
    """
    inv_freq = inverse_frequencies(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    signed_sin = torch.cat((-freqs, freqs), dim=-1).sin()
    return cos.to(device, dtype), signed_sin.to(device, dtype)


class _WeightTaker:
    """Takes tensors out of the checkpoint's dict by Hugging Face name, checks their shape,
    places them.

    Taking removes each tensor from the dict, so once a layer's q/k/v (or gate/up) are
    fused, nothing holds the separate parts: loading peaks at the model plus one fused
    tensor rather than twice the fused weights.
    """

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.weights = weights
        self.dtype = dtype
        self.device = device

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.weights.pop(name, None)
        if tensor is None:
            raise MissingWeights(f"checkpoint lacks the tensor {name}")
        if tuple(tensor.shape) != shape:
            raise MissingWeights(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(self.device, self.dtype).contiguous()

    def fused(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        parts = [self(n, s) for n, s in zip(names, shapes, strict=True)]
        return torch.cat(parts).contiguous()


def _load_layer(take: _WeightTaker, cfg: ModelConfig, index: int, prepack: bool) -> Layer:
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
    qkv_weight = take.fused([n + ".weight" for n in qkv_names], [(r, hidden) for r in qkv_rows])
    gate_up_weight = take.fused(
        [mlp + "gate_proj.weight", mlp + "up_proj.weight"], [(inter, hidden), (inter, hidden)]
    )
    return Layer(
        input_norm=take(prefix + "input_layernorm.weight", (hidden,)),
        qkv=Linear(qkv_weight, qkv_bias, prepack=prepack),
        o_proj=Linear(take(attn + "o_proj.weight", (hidden, q_rows)), prepack=prepack),
        post_norm=take(prefix + "post_attention_layernorm.weight", (hidden,)),
        gate_up=Linear(gate_up_weight, prepack=prepack),
        down=Linear(take(mlp + "down_proj.weight", (hidden, inter)), prepack=prepack),
    )
