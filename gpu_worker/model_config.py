"""The model facts the runtime needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_worker.protocol import ARCHITECTURES

ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """The directory holds a model this runtime cannot run."""


class ConfigError(ValueError):
    """config.json is missing or malformed."""


@dataclass(slots=True)
class RopeScaling:
    rope_type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    sliding_window: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        if not Path(path).is_dir():
            raise ConfigError(f"model directory {path} does not exist")
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{config_path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{config_path} does not hold a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(raw)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            config = cls(
                architecture=architecture,
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw),
                rope_scaling=_rope_scaling(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                vocab_size=int(raw["vocab_size"]),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; its config has no flag for them.
                attention_bias=architecture == "Qwen2ForCausalLM"
                or bool(raw.get("attention_bias", False)),
                bos_token_id=_optional_int(raw.get("bos_token_id")),
                sliding_window=_sliding_window(raw),
            )
        except UnsupportedModel:
            raise
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the required key {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json has a malformed value: {exc}") from exc
        config.check()
        return config

    def check(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModel(
                f"{self.num_attention_heads} attention heads are not a multiple of "
                f"{self.num_key_value_heads} key/value heads"
            )
        if self.head_dim % 2:
            raise UnsupportedModel(f"head_dim {self.head_dim} is odd; RoPE needs an even one")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def context_limit(self) -> int:
        """The longest sequence this model computes exactly (a sliding window caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    if not names and raw.get("model_type") in ARCHITECTURES:
        names = [ARCHITECTURES[raw["model_type"]]]
    for name in names:
        if name in ARCHITECTURES.values():
            return name
    found = ", ".join(names) or f"model_type {raw.get('model_type')!r}"
    raise UnsupportedModel(
        f"unsupported architecture {found}; supported: {', '.join(ARCHITECTURES.values())}"
    )


def _rope_dict(raw: dict[str, Any]) -> dict[str, Any] | None:
    # transformers >= 5 writes "rope_parameters" (rope_theta inside); older ones "rope_scaling".
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if isinstance(value, dict):
            return value
    return None


def _rope_theta(raw: dict[str, Any]) -> float:
    rope = _rope_dict(raw) or {}
    return float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    rope = _rope_dict(raw)
    if rope is None:
        return None
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    factor = float(rope["factor"])
    if not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"rope scaling factor must be positive, got {factor}")
    if rope_type == "linear":
        return RopeScaling("linear", factor)
    return RopeScaling(
        "llama3",
        factor,
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings") or raw["max_position_embeddings"]
        ),
    )


def _sliding_window(raw: dict[str, Any]) -> int | None:
    if raw.get("use_sliding_window") is False:
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None
