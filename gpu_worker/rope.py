"""Rotary position embeddings: the cos and sin tables of each RoPE a model uses.

Each follows transformers' ROPE_INIT_FUNCTIONS step by step, in float32 (default, linear,
llama3, yarn, longrope, proportional), including the attention factor that scales cos and sin (yarn,
longrope).

Longrope has two factor sets, short and long. transformers picks one per forward call by
the call's length (a prompt longer than original_max_position_embeddings rotates with the
long factors throughout; a shorter one with the short, and its decode steps past that
length with the long, beside keys cached with the short), so a token's rotation would
depend on how its sequence was chunked. As llama.cpp, the worker picks once by the context
it serves: the long factors when that exceeds the original length, else the short. The
first matches transformers on prompts longer than the original length, the second on
every sequence within it.
"""

from __future__ import annotations

import math

import torch

from gpu_worker.model_config import Rope, RopeScaling


def inverse_frequencies(head_dim: int, rope: Rope, long: bool = False) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies; `long`: longrope's long factors (ignored by the
    other types)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    scaling = rope.scaling
    if scaling is not None and scaling.rope_type == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(head_dim, rope.theta, scaling)
    if scaling.rope_type == "proportional":
        # Gemma 4's global layers: the first share of the frequencies, the others zero
        # (cos 1, sin 0: those dimensions pass unrotated)
        rotated = int(scaling.rotary_fraction * head_dim // 2)
        return (
            torch.cat([inv_freq[:rotated], torch.zeros(len(inv_freq) - rotated)]) / scaling.factor
        )
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


def _yarn_frequencies(dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    # Exactly transformers' _compute_yarn_parameters.
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rope_tables(
    head_dim: int,
    rope: Rope | None,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [max_positions, head_dim], computed in float32 like transformers.

    The signed sin is sin with its first half negated, the form layer_ops.apply_rope takes.
    `rope` None (a NoPE layer, SmolLM3's): cos 1 and sin 0, a rotation that leaves q and k
    as they are bit for bit (x * 1 + roll(x) * 0), so every kernel that rotates and caches
    in one pass serves such a layer unchanged, for one wasted multiply-add per element.
    """
    if rope is None:
        shape = (max_positions, head_dim)
        return torch.ones(shape, dtype=dtype, device=device), torch.zeros(
            shape, dtype=dtype, device=device
        )
    scaling = rope.scaling
    long = scaling is not None and max_positions > scaling.original_max_position_embeddings
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inverse_frequencies(head_dim, rope, long))
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    signed_sin = torch.cat((-freqs, freqs), dim=-1).sin()
    if scaling is not None and scaling.attention_factor != 1.0:
        cos, signed_sin = cos * scaling.attention_factor, signed_sin * scaling.attention_factor
    return cos.to(device, dtype), signed_sin.to(device, dtype)
