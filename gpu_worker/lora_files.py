"""A PEFT LoRA adapter directory read and checked against the base model.

The directory holds adapter_config.json (r, lora_alpha, target_modules, use_rslora, ...)
and adapter_model.safetensors, whose tensors PEFT names
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in]) and
`....lora_B.weight` ([out, r]). The scale is alpha / r, or alpha / sqrt(r) with rsLoRA.

What cadence cannot apply is refused, naming it: a module beyond the seven projections
(q/k/v/o, gate/up/down), a rank above the worker's max_lora_rank, per-module ranks or
alphas (rank_pattern, alpha_pattern), trained biases, DoRA, modules_to_save, transposed
weights (fan_in_fan_out), a subset of layers. Every error is a ValueError whose message
names the field or tensor (the service answers it as a 400).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_worker.model_config import ModelConfig

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."


@dataclass(slots=True)
class LoraAdapter:
    """One adapter's weights, as the files hold them (on the CPU)."""

    rank: int
    scale: float
    # (layer, module) -> (A [rank, in], B [out, rank]); every layer of each target module
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}


def module_shape(config: ModelConfig, layer: int, module: str) -> tuple[int, int]:
    """(out, in) of `module`'s base weight in layer `layer`."""
    hidden, head_dim = config.hidden_size, config.head_dim_of(layer)
    queries = config.num_attention_heads * head_dim
    shapes = {
        "q_proj": (queries, hidden),
        "k_proj": (config.kv_heads_of(layer) * head_dim, hidden),
        "v_proj": (config.kv_heads_of(layer) * head_dim, hidden),
        "o_proj": (hidden, queries),
        "gate_proj": (config.intermediate_of(layer), hidden),
        "up_proj": (config.intermediate_of(layer), hidden),
        "down_proj": (hidden, config.intermediate_of(layer)),
    }
    return shapes[module]


def tensor_name(layer: int, module: str, part: str) -> str:
    """PEFT's name of a module's lora_A or lora_B weight (`part`: "A" or "B")."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"{PREFIX}{layer}.{block}.{module}.lora_{part}.weight"


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter at `path` checked against `config` (ValueError naming what does not fit)."""
    directory = Path(path)
    settings = _read_config(directory / CONFIG_FILE)
    rank, modules = _checked_settings(settings, max_rank)
    alpha = settings.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _read_tensors(directory / WEIGHTS_FILE)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for module in modules:
            out, inp = module_shape(config, layer, module)
            a = _take(tensors, tensor_name(layer, module, "A"), (rank, inp))
            b = _take(tensors, tensor_name(layer, module, "B"), (out, rank))
            weights[(layer, module)] = (a, b)
    if tensors:
        raise ValueError(f"{WEIGHTS_FILE}: tensors cadence cannot apply: {sorted(tensors)[:4]}")
    return LoraAdapter(rank, float(scale), weights)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{CONFIG_FILE} not found in {path.parent}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{CONFIG_FILE}: not JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{CONFIG_FILE}: not a JSON object")
    return settings


def _checked_settings(settings: dict[str, Any], max_rank: int) -> tuple[int, tuple[str, ...]]:
    """The rank and target modules, once every setting cadence cannot apply is refused."""
    if settings.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type {settings['peft_type']!r} is not LORA")
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{CONFIG_FILE}: r is {rank}, above the worker's max_lora_rank {max_rank}")
    refused = {
        "bias": settings.get("bias", "none") != "none",
        "use_dora": bool(settings.get("use_dora")),
        "modules_to_save": bool(settings.get("modules_to_save")),
        "rank_pattern": bool(settings.get("rank_pattern")),
        "alpha_pattern": bool(settings.get("alpha_pattern")),
        "fan_in_fan_out": bool(settings.get("fan_in_fan_out")),
        "layers_to_transform": settings.get("layers_to_transform") is not None,
    }
    named = [field for field, set_ in refused.items() if set_]
    if named:
        raise ValueError(f"{CONFIG_FILE}: {', '.join(named)} not supported (set in the adapter)")
    targets = settings.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise ValueError(
            f"{CONFIG_FILE}: target_modules must be a list of module names, got {targets!r}"
        )
    unknown = [name for name in targets if name not in TARGET_MODULES]
    if unknown:
        raise ValueError(
            f"{CONFIG_FILE}: target_modules {unknown} not among {', '.join(TARGET_MODULES)}"
        )
    return rank, tuple(module for module in TARGET_MODULES if module in targets)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"{WEIGHTS_FILE} not found in {path.parent}")
    try:
        return load_file(path)
    except SafetensorError as exc:
        raise ValueError(f"{WEIGHTS_FILE}: unreadable ({exc})") from None


def _take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, int]) -> torch.Tensor:
    tensor = tensors.pop(name, None)
    if tensor is None:
        raise ValueError(f"{WEIGHTS_FILE}: {name} missing")
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{WEIGHTS_FILE}: {name} has shape {list(tensor.shape)}, the base model's is "
            f"{list(shape)}"
        )
    return tensor
