"""Gemma 4's per-layer inputs: beside the residual stream, each layer gets a small vector
per token, made once per step from the token (its row of a second embedding) and from its
embedding (a projection of it), exactly as transformers' Gemma4TextModel combines them.

Each layer gates its residual stream into that width, multiplies by its slice, projects it
back and adds it (gpu_worker.model, after the MLP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.model_config import ModelConfig
from gpu_worker.quant import Matmul
from gpu_worker.weights import WeightTaker

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
COMBINED_SCALE = 2.0**-0.5  # the two parts' sum is scaled by it


@dataclass(slots=True)
class PerLayerInputs:
    embed: torch.Tensor  # [per-layer vocabulary, layers * width]
    embed_scale: torch.Tensor  # sqrt(width), rounded to the model's dtype
    projection: Matmul  # [layers * width, hidden]
    projection_norm: torch.Tensor  # [width]
    layers: int
    width: int
    projection_scale: float  # hidden ** -0.5
    eps: float

    @classmethod
    def load(cls, take: WeightTaker, cfg: ModelConfig) -> PerLayerInputs:
        layers, width = cfg.num_hidden_layers, cfg.per_layer_input_size
        embed = take(
            "model.embed_tokens_per_layer.weight", (cfg.per_layer_vocab_size, layers * width)
        )
        return cls(
            embed=embed,
            embed_scale=torch.tensor(width**0.5).to(embed.device, embed.dtype),
            projection=take.matmul(
                ["model.per_layer_model_projection.weight"], [(layers * width, cfg.hidden_size)]
            ),
            projection_norm=take.norm("model.per_layer_projection_norm.weight", width),
            layers=layers,
            width=width,
            projection_scale=cfg.hidden_size**-0.5,
            eps=cfg.rms_norm_eps,
        )

    def __call__(self, input_ids: torch.Tensor, embedded: torch.Tensor, norm: Norm) -> torch.Tensor:
        """[T] ids and their scaled embeddings [T, hidden] -> [T, layers, width]."""
        own = F.embedding(input_ids, self.embed) * self.embed_scale
        projected = self.projection(embedded) * self.projection_scale
        projected = norm(
            projected.view(-1, self.layers, self.width), self.projection_norm, self.eps
        )
        return (projected + own.view(-1, self.layers, self.width)) * COMBINED_SCALE
