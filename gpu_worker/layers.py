"""A decoder layer's tensors, taken from the checkpoint by their Hugging Face names.

One Layer record serves every family (gpu_worker.model_config.FAMILIES): the parts a
family lacks are None, and the model's forward pass skips them. q/k/v and gate/up are
fused into single matmuls at load (Phi-3's checkpoint holds them fused already), each
part leaving the checkpoint's dict as it is taken (see WeightTaker). Gemma's norm weights
are stored as 1 + w in float32, the form layer_ops.gemma_rms_norm takes. With a
quantization (gpu_worker.quant) the attention and MLP matmuls are QuantLinears, their
weights quantized here or taken quantized from a GGUF conversion; a mixture of experts'
matmuls stay dense. Under tensor parallelism (gpu_worker.tensor_parallel) each rank takes
only its slice of each weight, cut as the Split the loader names for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.linear import ROW_SIZES, Linear
from gpu_worker.model_config import ModelConfig
from gpu_worker.moe import MoEMLP, load_moe
from gpu_worker.quant import Matmul, Quantizer, QuantLinear, QuantWeight
from gpu_worker.tensor_parallel import COLUMNS, NO_SHARD, ROWS, WHOLE, Shard, Split, fused_rows


class MissingWeights(ValueError):
    """The checkpoint lacks tensors the architecture needs, or has the wrong shapes."""


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor
    qkv: Matmul  # [(heads + 2 * kv_heads) * head_dim, hidden], with Qwen2's biases
    o_proj: Matmul
    mlp_norm: torch.Tensor  # before the MLP (Llama's post_attention_layernorm)
    gate_up: Matmul | None  # [2 * intermediate, hidden]; None in a mixture-of-experts layer
    down: Matmul | None
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

    `matmul_kernel` is the dense matmuls' kernel (gpu_worker.linear.Linear's `kernel`);
    `quantizer` (gpu_worker.quant.QUANTIZERS) quantizes the matmuls' weights as they are
    taken; `quantized` holds weights already quantized (a GGUF file's), by name, which
    `matmul` serves in their own formats; `quant_kernels` is the quantized kernel's
    namespace, or None for the reference. `shard` is the rank's part of a tensor-parallel
    model: each weight's shape is checked whole, then only the rank's slice is kept.
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        matmul_kernel: str,
        gemma_norms: bool = False,
        text_prefixes: tuple[str, ...] = (),
        *,
        quantizer: Quantizer | None = None,
        quantized: dict[str, QuantWeight] | None = None,
        quant_kernels: Any | None = None,
        shard: Shard = NO_SHARD,
    ):
        for name in [n for n in weights if n.startswith(text_prefixes)]:
            prefix = next(p for p in text_prefixes if name.startswith(p))
            weights["model." + name.removeprefix(prefix)] = weights.pop(name)
        if "language_model.lm_head.weight" in weights:
            weights["lm_head.weight"] = weights.pop("language_model.lm_head.weight")
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.matmul_kernel = matmul_kernel
        self.gemma_norms = gemma_norms
        self.quantizer = quantizer
        self.quantized = {} if quantized is None else quantized
        self.quant_kernels = quant_kernels
        self.shard = shard

    def __call__(self, name: str, shape: tuple[int, ...], split: Split = WHOLE) -> torch.Tensor:
        """The tensor `name` of the checkpoint's `shape`: the rank's part of it (`split`)."""
        tensor = self.weights.pop(name, None)
        if tensor is None:
            raise MissingWeights(f"checkpoint lacks the tensor {name}")
        if tuple(tensor.shape) != shape:
            raise MissingWeights(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        return self.shard.slice(tensor, split).to(self.device, self.dtype).contiguous()

    def norm(self, name: str, size: int) -> torch.Tensor:
        """An RMSNorm's weight; Gemma's as 1 + w in float32."""
        if not self.gemma_norms:
            return self(name, (size,))
        weight = self.weights.get(name)
        self(name, (size,))  # checks and removes it
        assert weight is not None
        return (1.0 + weight.to(self.device, torch.float32)).contiguous()

    def fused(
        self, names: list[str], shapes: Sequence[tuple[int, ...]], split: Split = WHOLE
    ) -> torch.Tensor:
        parts = [self(n, s, split) for n, s in zip(names, shapes, strict=True)]
        return torch.cat(parts).contiguous()

    def linear(self, name: str, shape: tuple[int, int]) -> Linear:
        return Linear(self(name + ".weight", shape), kernel=self.matmul_kernel)

    def quantizes(self, name: str) -> bool:
        """Whether the weight `name` is served quantized."""
        return self.quantizer is not None or name in self.quantized

    def matmul(
        self,
        names: list[str],
        shapes: list[tuple[int, int]],
        bias: torch.Tensor | None = None,
        sizes: tuple[int, ...] = ROW_SIZES,
        dense: torch.Tensor | None = None,
        split: Split = WHOLE,
    ) -> Matmul:
        """The matmul of the weights `names` fused (a tied LM head: `dense`, the embedding
        already taken), quantized where the taker quantizes or holds them quantized; dense
        where it holds none of them quantized and quantizes nothing (a GGUF file's float
        tensors). Each weight is cut by `split` before the fusing (`dense` is cut already)."""
        if not any(self.quantizes(n) for n in names):
            weight = self.fused(names, shapes, split) if dense is None else dense
            return Linear(weight, bias, kernel=self.matmul_kernel, sizes=sizes)
        parts = [self._quantized(n, s, dense, split) for n, s in zip(names, shapes, strict=True)]
        return QuantLinear(parts, bias, native=self.quant_kernels, dtype=self.dtype, sizes=sizes)

    def _quantized(
        self, name: str, shape: tuple[int, int], dense: torch.Tensor | None, split: Split
    ) -> QuantWeight:
        """A stored quantized weight whole (Model refuses them under tensor parallelism), or
        the taker's quantizer on the rank's slice: rows quantize alike whole or sliced, and
        check_shardable keeps the columns' slices in whole groups."""
        stored = self.quantized.pop(name, None)
        if stored is not None:
            self.weights.pop(name, None)  # its dequantized copy
            if tuple(stored.values.shape) != shape:
                raise MissingWeights(f"{name} has shape {tuple(stored.values.shape)}, not {shape}")
            return stored.to(self.device)
        if self.quantizer is None:
            raise MissingWeights(
                f"{name} is stored unquantized beside quantized weights it is fused with"
            )
        return self.quantizer(self(name, shape, split) if dense is None else dense)

    def gated_mlp(self, names: Sequence[str], hidden: int, inter: int) -> tuple[Linear, Linear]:
        """(gate_up, down) of a gated MLP whose gate, up and down weights are `names`: a
        mixture of experts' experts, dense whatever the quantization."""
        gate, up, down = names
        gate_up = self.fused([gate + ".weight", up + ".weight"], [(inter, hidden)] * 2)
        return Linear(gate_up, kernel=self.matmul_kernel), self.linear(down, (hidden, inter))


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
        o_proj=take.matmul([attn + "o_proj.weight"], [(hidden, heads * head_dim)], split=COLUMNS),
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
        local_heads, local_kv_heads = take.shard.local(heads), take.shard.local(kv_heads)
        layer.qk_norm = torch.cat(
            [q_norm.expand(local_heads, -1), k_norm.expand(local_kv_heads, -1)]
        )
    if family.gemma:
        layer.attn_out_norm = take.norm(prefix + "post_attention_layernorm.weight", hidden)
        layer.mlp_out_norm = take.norm(prefix + "post_feedforward_layernorm.weight", hidden)
    if cfg.moe is not None and cfg.moe.sparse_layers[index]:
        layer.moe = load_moe(take, cfg, prefix)
    elif family.fused_projections:
        inter = cfg.intermediate_size
        layer.gate_up = take.matmul(
            [prefix + "mlp.gate_up_proj.weight"],
            [(2 * inter, hidden)],
            split=fused_rows(inter, inter),
        )
        layer.down = take.matmul(
            [prefix + "mlp.down_proj.weight"], [(hidden, inter)], split=COLUMNS
        )
    else:
        mlp, inter = prefix + "mlp.", cfg.intermediate_size
        names = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        layer.gate_up = take.matmul(names, [(inter, hidden)] * 2, split=ROWS)
        layer.down = take.matmul([mlp + "down_proj.weight"], [(hidden, inter)], split=COLUMNS)
    return layer


def _qkv(take: WeightTaker, cfg: ModelConfig, attn: str) -> Matmul:
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_attention_heads * head_dim
    kv_rows = cfg.num_key_value_heads * head_dim
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
