"""A decoder layer's tensors, taken from the checkpoint by their Hugging Face names.

One Layer record serves every family (gpu_worker.model_config.FAMILIES): the parts a
family lacks are None, and the model's forward pass skips them. q/k/v and gate/up are
fused into single matmuls at load (Phi-3's checkpoint holds them fused already), each
part leaving the checkpoint's dict as it is taken (gpu_worker.weights). Gemma's norm weights
are stored as 1 + w in float32 (Gemma 4's as w), the form layer_ops.gemma_rms_norm takes. A
Gemma 4 layer that reads an earlier layer's K/V has a q projection alone. A linear-attention
layer (Qwen3-Next, Qwen3.5) has its in_proj as qkv, its out_proj as o_proj and its other
parts in `linear` (gpu_worker.linear_attention); their full-attention layers' q_proj gives
each head's queries then its gate, split at load into qkv's q and `attn_gate`. With a
quantization (gpu_worker.quant) the attention and MLP matmuls are QuantLinears, their
weights quantized here or taken quantized from a GGUF conversion; a mixture of experts'
matmuls stay dense. Under tensor parallelism (gpu_worker.tensor_parallel) each rank takes
only its slice of each weight, cut as the Split the loader names for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.linear_attention import GatedDeltaNet, load_gated_delta_net
from gpu_worker.model_config import ModelConfig
from gpu_worker.moe import MoEMLP, load_moe
from gpu_worker.quant import Matmul
from gpu_worker.tensor_parallel import COLUMNS, ROWS, fused_rows
from gpu_worker.weights import WeightTaker


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor
    # [(heads + 2 * kv_heads) * head_dim, hidden] (the layer's own head_dim), with Qwen2's biases
    qkv: Matmul
    o_proj: Matmul
    mlp_norm: torch.Tensor  # before the MLP (Llama's post_attention_layernorm)
    gate_up: Matmul | None  # [2 * intermediate, hidden]; None in a mixture-of-experts layer
    down: Matmul | None
    cos: torch.Tensor  # the layer's RoPE tables (rope.rope_tables), shared with its kind
    signed_sin: torch.Tensor
    attention: int  # its KV group (gpu_worker.kv_groups), whose attention records it reads
    # [heads + kv_heads, head_dim]: q heads', then k's (and Gemma 4's v heads', ones)
    qk_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma's post_attention_layernorm
    mlp_out_norm: torch.Tensor | None = None  # Gemma's post_feedforward_layernorm
    moe: MoEMLP | None = None
    sinks: torch.Tensor | None = None  # [heads]: gpt-oss's per-head logit in the softmax
    # Gemma 4's per-layer input: gate [P, hidden], projection [hidden, P] and its norm
    per_layer_gate: Matmul | None = None
    per_layer_projection: Matmul | None = None
    per_layer_norm: torch.Tensor | None = None
    scalar: torch.Tensor | None = None  # [1]: Gemma 4 scales the residual stream by it
    linear: GatedDeltaNet | None = None  # a linear-attention layer's parts (qkv: in_proj)
    # [heads * head_dim, hidden]: the gated attention's gate (output * sigmoid(gate))
    attn_gate: Matmul | None = None


def load_layer(
    take: WeightTaker,
    cfg: ModelConfig,
    index: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    kind: int,
) -> Layer:
    prefix = f"model.layers.{index}."
    hidden, family, head_dim = cfg.hidden_size, cfg.family, cfg.head_dim_of(index)
    attn = prefix + "self_attn."
    if cfg.is_linear(index):
        return _linear_layer(take, cfg, index, rope, kind)
    if family.linear_attention:
        _split_gate(take.weights, attn, cfg)
    layer = Layer(
        input_norm=take.norm(prefix + "input_layernorm.weight", hidden),
        qkv=_qkv(take, cfg, attn, index)
        if cfg.kv_source(index) == index
        else _q(take, cfg, attn, head_dim),
        o_proj=_o_proj(take, cfg, attn, head_dim),
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
        layer.qk_norm = _head_norms(take, cfg, attn, index)
    if family.attention_sinks:
        layer.sinks = take(attn + "sinks", (cfg.num_attention_heads,), ROWS)
    if family.gemma:
        layer.attn_out_norm = take.norm(prefix + "post_attention_layernorm.weight", hidden)
        layer.mlp_out_norm = take.norm(prefix + "post_feedforward_layernorm.weight", hidden)
    if family.gemma4:
        _add_gemma4_parts(take, cfg, prefix, layer)
    if family.linear_attention:
        shape = (cfg.num_attention_heads * head_dim, hidden)
        layer.attn_gate = take.matmul([attn + "q_gate.weight"], [shape], split=ROWS)
    _add_mlp(take, cfg, prefix, index, layer)
    return layer


def _add_mlp(take: WeightTaker, cfg: ModelConfig, prefix: str, index: int, layer: Layer) -> None:
    if cfg.moe is not None and cfg.moe.sparse_layers[index]:
        layer.moe = load_moe(take, cfg, prefix)
    if layer.moe is None or layer.moe.config.beside_dense:
        layer.gate_up, layer.down = _dense_mlp(take, cfg, prefix, index)


def _linear_layer(
    take: WeightTaker,
    cfg: ModelConfig,
    index: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    kind: int,
) -> Layer:
    """A Gated DeltaNet layer (gpu_worker.linear_attention): in_proj as qkv, out_proj as
    o_proj; its rope tables and KV group are placeholders it never reads."""
    linear = cfg.linear_attention
    assert linear is not None
    hidden, prefix = cfg.hidden_size, f"model.layers.{index}."
    in_proj, parts = load_gated_delta_net(take, cfg, prefix)
    out_shape = (hidden, linear.value_heads * linear.value_dim)
    layer = Layer(
        input_norm=take.norm(prefix + "input_layernorm.weight", hidden),
        qkv=in_proj,
        o_proj=take.matmul([prefix + "linear_attn.out_proj.weight"], [out_shape]),
        mlp_norm=take.norm(prefix + "post_attention_layernorm.weight", hidden),
        gate_up=None,
        down=None,
        cos=rope[0],
        signed_sin=rope[1],
        attention=kind,
        linear=parts,
    )
    _add_mlp(take, cfg, prefix, index, layer)
    return layer


def _split_gate(weights: dict[str, torch.Tensor], attn: str, cfg: ModelConfig) -> None:
    """The gated attention's q_proj [heads * 2 * head_dim, hidden] (each head's queries,
    then its gate, as transformers' Qwen3NextAttention chunks them) in the checkpoint's
    dict as q_proj and q_gate [heads * head_dim, hidden] each."""
    fused = weights.pop(attn + "q_proj.weight")
    by_head = fused.view(cfg.num_attention_heads, 2, cfg.head_dim, fused.shape[-1])
    weights[attn + "q_proj.weight"] = by_head[:, 0].reshape(-1, fused.shape[-1])
    weights[attn + "q_gate.weight"] = by_head[:, 1].reshape(-1, fused.shape[-1])


def _dense_mlp(
    take: WeightTaker, cfg: ModelConfig, prefix: str, index: int
) -> tuple[Matmul, Matmul]:
    """(gate_up [2 * intermediate, hidden], down) of the layer's dense MLP."""
    hidden, mlp, inter = cfg.hidden_size, prefix + "mlp.", cfg.intermediate_of(index)
    down = take.matmul([mlp + "down_proj.weight"], [(hidden, inter)], split=COLUMNS)
    if cfg.family.fused_projections:
        gate_up = take.matmul(
            [mlp + "gate_up_proj.weight"], [(2 * inter, hidden)], split=fused_rows(inter, inter)
        )
        return gate_up, down
    names = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
    return take.matmul(names, [(inter, hidden)] * 2, split=ROWS), down


def _qkv(take: WeightTaker, cfg: ModelConfig, attn: str, index: int) -> Matmul:
    """q, k and v fused; q and k alone where the values are the keys' projection (Gemma 4's
    attention_k_eq_v: the model copies them)."""
    hidden, head_dim = cfg.hidden_size, cfg.head_dim_of(index)
    q_rows = cfg.num_attention_heads * head_dim
    kv_rows = cfg.kv_heads_of(index) * head_dim
    if cfg.values_from_keys(index):
        names = [f"{attn}{p}_proj.weight" for p in ("q", "k")]
        return take.matmul(names, [(q_rows, hidden), (kv_rows, hidden)], split=ROWS)
    qkv_rows = [q_rows, kv_rows, kv_rows]
    if cfg.family.fused_projections:
        fused = [attn + "qkv_proj.weight"]
        return take.matmul(fused, [(sum(qkv_rows), hidden)], split=fused_rows(*qkv_rows))
    qkv_names = [f"{attn}{p}_proj" for p in ("q", "k", "v")]
    qkv_bias = None
    if cfg.attention_bias:
        biases = [n + ".bias" for n in qkv_names]
        qkv_bias = take.fused(biases, [(r,) for r in qkv_rows], split=ROWS)
    qkv_weights = [n + ".weight" for n in qkv_names]
    return take.matmul(qkv_weights, [(r, hidden) for r in qkv_rows], qkv_bias, split=ROWS)


def _o_proj(take: WeightTaker, cfg: ModelConfig, attn: str, head_dim: int) -> Matmul:
    """The attention's output projection; with gpt-oss's bias (tensor parallelism, which
    would add it on every rank, refuses gpt-oss as a mixture of experts)."""
    shape = (cfg.hidden_size, cfg.num_attention_heads * head_dim)
    bias = None
    if cfg.family.o_proj_bias and cfg.attention_bias:
        bias = take(attn + "o_proj.bias", (cfg.hidden_size,))
    return take.matmul([attn + "o_proj.weight"], [shape], bias, split=COLUMNS)


def _q(take: WeightTaker, cfg: ModelConfig, attn: str, head_dim: int) -> Matmul:
    """The queries alone, of a layer that reads another layer's K/V (Gemma 4)."""
    shape = (cfg.num_attention_heads * head_dim, cfg.hidden_size)
    return take.matmul([attn + "q_proj.weight"], [shape], split=ROWS)


def _head_norms(take: WeightTaker, cfg: ModelConfig, attn: str, index: int) -> torch.Tensor:
    """The norms over each q head, then each k head, and for Gemma 4 each v head (an
    unscaled norm: ones) [heads (+ 2 kv_heads), head_dim], at the layer's own head_dim and
    key/value heads; a layer that reads another layer's K/V norms its q heads alone."""
    head_dim, owns_kv = cfg.head_dim_of(index), cfg.kv_source(index) == index
    local_heads = take.shard.local(cfg.num_attention_heads)
    local_kv_heads = take.shard.local(cfg.kv_heads_of(index))
    norms = [take.norm(attn + "q_norm.weight", head_dim).expand(local_heads, -1)]
    if owns_kv:
        k_norm = take.norm(attn + "k_norm.weight", head_dim)
        norms.append(k_norm.expand(local_kv_heads, -1))
    if owns_kv and cfg.family.gemma4:
        norms.append(torch.ones_like(k_norm).expand(local_kv_heads, -1))
    return torch.cat(norms)


def _add_gemma4_parts(take: WeightTaker, cfg: ModelConfig, prefix: str, layer: Layer) -> None:
    """Gemma 4's layer scalar, and its per-layer input's gate, projection and norm."""
    layer.scalar = take(prefix + "layer_scalar", (1,))
    size, hidden = cfg.per_layer_input_size, cfg.hidden_size
    if not size:
        return
    layer.per_layer_gate = take.matmul([prefix + "per_layer_input_gate.weight"], [(size, hidden)])
    layer.per_layer_projection = take.matmul(
        [prefix + "per_layer_projection.weight"], [(hidden, size)]
    )
    layer.per_layer_norm = take.norm(prefix + "post_per_layer_input_norm.weight", hidden)
