"""Taking a checkpoint's tensors by their Hugging Face names: shapes checked, each placed on
the device in the model's dtype, the matmuls' weights fused and quantized as they are
taken, and under tensor parallelism only the rank's slice kept (gpu_worker.tensor_parallel).

The layers' loaders (gpu_worker.layers, gpu_worker.moe) and the model's (gpu_worker.model)
take their weights through one WeightTaker, which is why it lives apart from any of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gpu_worker import mxfp4
from gpu_worker.linear import ROW_SIZES, Linear
from gpu_worker.quant import Matmul, Quantizer, QuantLinear, QuantWeight
from gpu_worker.tensor_parallel import NO_SHARD, WHOLE, Shard, Split


class MissingWeights(ValueError):
    """The checkpoint lacks tensors the architecture needs, or has the wrong shapes."""


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
        norm_offset: float | None = None,
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
        self.norm_offset = norm_offset
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
        """An RMSNorm's weight; with a `norm_offset` (Gemma's), offset + w in float32: 1 + w
        for Gemma 2 and 3, w for Gemma 4."""
        if self.norm_offset is None:
            return self(name, (size,))
        weight = self.weights.get(name)
        self(name, (size,))  # checks and removes it
        assert weight is not None
        return (self.norm_offset + weight.to(self.device, torch.float32)).contiguous()

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

    def mxfp4_experts(self, name: str, shape: tuple[int, int, int]) -> list[QuantWeight] | None:
        """The weight `name` of `shape` ([experts, in, out], transformers' dense layout)
        where the checkpoint holds it in MXFP4 kept packed (gpu_worker.mxfp4): each expert's
        [out, in] QuantWeight; None where it holds it dense."""
        blocks = self.weights.pop(name + mxfp4.BLOCKS, None)
        if blocks is None:
            return None
        scales = self.weights.pop(name + mxfp4.SCALES)
        experts, cols, rows = shape
        stored = (experts, rows, cols // 32, 16)
        if tuple(blocks.shape) != stored:
            raise MissingWeights(
                f"{name}{mxfp4.BLOCKS} has shape {tuple(blocks.shape)}, not {stored}"
            )
        return [weight.to(self.device) for weight in mxfp4.quant_weights(blocks, scales)]

    def gated_mlp(self, names: Sequence[str], hidden: int, inter: int) -> tuple[Linear, Linear]:
        """(gate_up, down) of a gated MLP whose gate, up and down weights are `names`: a
        mixture of experts' experts, dense whatever the quantization."""
        gate, up, down = names
        gate_up = self.fused([gate + ".weight", up + ".weight"], [(inter, hidden)] * 2)
        return Linear(gate_up, kernel=self.matmul_kernel), self.linear(down, (hidden, inter))
