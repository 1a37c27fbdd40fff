"""The kernel backend: which implementation of each hot operation a worker runs.

Three seams, each with its candidates:
- attention: NativeAttention, NativeRowsAttention, HybridAttention (CPU), FlexAttention,
  TritonAttention (CUDA; the latter where triton imports), TorchAttention
  (gpu_worker.attention);
- layer ops: NativeLayerOps, CompiledLayerOps (CUDA), TorchLayerOps (gpu_worker.layer_ops),
  TritonLayerOps (CUDA, where triton imports; gpu_worker.triton_layer_ops);
- matmul: "native" (cadence's bfloat16 kernel), "onednn" (weights prepacked once) or
  "aten" (F.linear); see gpu_worker.linear.Linear.

Weights kept quantized (gpu_worker.quant) have no seam to measure: the C++ kernel serves
them where it is built (a CPU with AVX512-VNNI or AVX2) and the PyTorch reference elsewhere. The
two give the same bits, and the reference is the slow correct path, never the faster one.

A candidate is offered where it can run: the native ones on CPUs where the C++ kernels
build (and the chunk kernel where the CPU has AVX512-BF16), oneDNN where PyTorch has it,
FlexAttention on CUDA (compiled through Triton; on a CPU it only runs eagerly, densely);
the PyTorch ones everywhere, as the reference. gpu_worker.kernel_choice measures them on
the model's shapes and picks; the model and the runner ask the Kernels they are given and
never look at the device themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker import native
from gpu_worker.attention import (
    FULL,
    AttentionBackend,
    FlexAttention,
    HybridAttention,
    LayerAttention,
    NativeAttention,
    NativeRowsAttention,
    TorchAttention,
)
from gpu_worker.layer_ops import CompiledLayerOps, LayerOps, NativeLayerOps, TorchLayerOps
from gpu_worker.protocol import KERNEL_SEAMS

SEAMS = KERNEL_SEAMS


@dataclass(frozen=True, slots=True)
class Kernels:
    attention: AttentionBackend
    layer_ops: LayerOps
    matmul: str  # "native", "onednn" or "aten"
    # torch.ops.cadence for weights kept quantized; None: the reference (quant_kernels)
    quant_matmul: Any | None = None

    def names(self) -> dict[str, str]:
        return {
            "attention": self.attention.name,
            "layer_ops": self.layer_ops.name,
            "matmul": self.matmul,
        }


def reference() -> Kernels:
    """PyTorch everywhere: runs on any device; what every candidate is checked against."""
    return Kernels(TorchAttention(), TorchLayerOps(), "aten")


def attention_candidates(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    layers: Sequence[LayerAttention] = (FULL,),
) -> list[AttentionBackend]:
    """The backends that run here and serve every kind of the model's attention `layers`
    (a backend without sliding windows is never offered for a model that has them)."""
    kernels = native.kernels() if device.type == "cpu" else None
    found: list[AttentionBackend] = [TorchAttention()]
    if device.type == "cuda":
        found.append(FlexAttention())
        try:  # imported here: the CPU worker runs without triton
            from gpu_worker.attention.triton_backend import TritonAttention
        except ImportError:
            pass
        else:
            found.append(TritonAttention())
    if kernels is not None:
        found += [NativeRowsAttention(kernels), HybridAttention(kernels)]
        if NativeAttention.serves(device, dtype, head_dim):
            found.append(NativeAttention(kernels))
    return [backend for backend in found if backend.serves_layers(list(layers))]


def layer_ops_candidates(device: torch.device) -> list[LayerOps]:
    kernels = native.kernels() if device.type == "cpu" else None
    found: list[LayerOps] = [TorchLayerOps()]
    if device.type == "cuda":
        found.append(CompiledLayerOps())
        try:  # imported here: the CPU worker runs without triton
            from gpu_worker.triton_layer_ops import TritonLayerOps
        except ImportError:
            pass
        else:
            found.append(TritonLayerOps())
    return found + ([] if kernels is None else [NativeLayerOps(kernels)])


def matmul_candidates(device: torch.device, dtype: torch.dtype) -> list[str]:
    onednn = device.type == "cpu" and torch.backends.mkldnn.is_available()
    kernels = native.kernels() if device.type == "cpu" else None
    bf16 = dtype == torch.bfloat16 and hasattr(kernels, "bf16_matmul")
    return ["aten"] + (["onednn"] if onednn else []) + (["native"] if bf16 else [])


def quant_kernels(device: torch.device) -> Any | None:
    """The namespace of the quantized matmul's C++ ops where they are built for `device`."""
    kernels = native.kernels() if device.type == "cpu" else None
    return kernels if kernels is not None and hasattr(kernels, "quant_matmul") else None


def candidates(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    layers: Sequence[LayerAttention] = (FULL,),
) -> dict[str, list]:
    """Every seam's candidates, the reference first."""
    return {
        "attention": attention_candidates(device, dtype, head_dim, layers),
        "layer_ops": layer_ops_candidates(device),
        "matmul": matmul_candidates(device, dtype),
    }


def by_names(
    names: dict[str, str],
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    layers: Sequence[LayerAttention] = (FULL,),
) -> Kernels:
    """The Kernels a recorded choice names; KeyError when one is not offered here."""
    offered = candidates(device, dtype, head_dim, layers)
    chosen = {}
    for seam in SEAMS:
        by_name = {name_of(c): c for c in offered[seam]}
        chosen[seam] = by_name[names[seam]]
    return Kernels(**chosen)


def name_of(candidate: AttentionBackend | LayerOps | str) -> str:
    return candidate if isinstance(candidate, str) else candidate.name
