"""The model facts the runtime needs, read from a Hugging Face config.json.

The families differ by data, not by code: FAMILIES says, per architecture, which of the
shared features its layers have (q/k norms, Gemma's norms and GeGLU, fused checkpoint
projections, mixture-of-experts layouts); the config gives the sizes, the RoPE of each
layer type and each layer's attention window.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_worker.protocol import ARCHITECTURES

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
# transformers' defaults where a config names no base (Gemma 3's differ by layer type)
DEFAULT_THETA = {("gemma3_text", "full_attention"): 1e6}


class UnsupportedModel(ValueError):
    """The directory holds a model this runtime cannot run."""


class ConfigError(ValueError):
    """config.json is missing or malformed."""


@dataclass(frozen=True, slots=True)
class Family:
    """What an architecture's layers are made of, beyond the Llama layer."""

    qkv_bias: bool = False  # q/k/v biases whatever the config says (Qwen2)
    qkv_bias_default: bool = False  # q/k/v biases where the config names none (Qwen2-MoE)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # Gemma: (1 + w) norms in float32, norms after attention and MLP too, embeddings
    # scaled by sqrt(hidden), GeGLU, the attention scale from query_pre_attn_scalar
    gemma: bool = False
    fused_projections: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    moe: str | None = None  # the experts' layout: "mixtral", "qwen", "gpt_oss" or "gemma4"
    # a per-head logit in each attention softmax's denominator (gpt-oss's self_attn.sinks)
    attention_sinks: bool = False
    o_proj_bias: bool = False  # o_proj has a bias where attention_bias says so (gpt-oss)
    # A sliding window counts only with use_sliding_window (Qwen's configs default it off).
    window_opt_in: bool = False
    # The decoder is the text model of a multimodal one (Gemma 3's text_config): its
    # weights' names start with one of these instead of "model." (the rest is not loaded).
    text_prefixes: tuple[str, ...] = ()
    # Without layer_types, every n-th layer is global and the others windowed (Gemma:
    # sliding_window_pattern, or this default); 0: every layer is windowed.
    window_pattern: int = 0
    # Without no_rope_layers, every n-th layer rotates nothing (SmolLM3's NoPE layers:
    # no_rope_layer_interval, or this default); 0: every layer has RoPE.
    no_rope_interval: int = 0
    # Gemma 4, beyond Gemma: norms scale by w (not 1 + w), v is RMS-normed too (unscaled),
    # scores are not scaled (the q/k norms size them), per-layer input embeddings, the last
    # layers reading earlier layers' KV, and a scalar per layer on the residual stream
    gemma4: bool = False
    # Qwen3-Next and Qwen3.5: Gated DeltaNet linear-attention layers beside gated full
    # attention (q_proj gives each head's queries and a gate), zero-centred norms (1 + w)
    # and partial rotary embeddings; the checkpoint's in-projections: "qwen3_next" (q, k, v,
    # z fused per key head in in_proj_qkvz, b and a in in_proj_ba) or "qwen3_5" (in_proj_qkv,
    # in_proj_z, in_proj_b, in_proj_a)
    linear_attention: str | None = None


FAMILIES = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True, window_opt_in=True),
    "Qwen3ForCausalLM": Family(qk_norm=True, window_opt_in=True),
    "Gemma2ForCausalLM": Family(gemma=True, window_pattern=2),
    "Gemma3ForCausalLM": Family(qk_norm=True, gemma=True, window_pattern=6),
    "Gemma3ForConditionalGeneration": Family(
        qk_norm=True,
        gemma=True,
        text_prefixes=("model.language_model.", "language_model.model."),
        window_pattern=6,
    ),
    "Phi3ForCausalLM": Family(fused_projections=True),
    "MixtralForCausalLM": Family(moe="mixtral"),
    "Qwen2MoeForCausalLM": Family(qkv_bias_default=True, moe="qwen", window_opt_in=True),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, moe="qwen", window_opt_in=True),
    "SmolLM3ForCausalLM": Family(window_opt_in=True, no_rope_interval=4),
    "Gemma4ForCausalLM": Family(
        qk_norm=True, gemma=True, gemma4=True, moe="gemma4", window_pattern=6
    ),
    "Gemma4ForConditionalGeneration": Family(
        qk_norm=True,
        gemma=True,
        gemma4=True,
        moe="gemma4",
        text_prefixes=("model.language_model.",),
        window_pattern=6,
    ),
    "GptOssForCausalLM": Family(
        moe="gpt_oss", attention_sinks=True, o_proj_bias=True, window_pattern=2
    ),
    "Qwen3NextForCausalLM": Family(qk_norm=True, moe="qwen", linear_attention="qwen3_next"),
    "Qwen3_5ForCausalLM": Family(qk_norm=True, linear_attention="qwen3_5"),
    "Qwen3_5ForConditionalGeneration": Family(
        qk_norm=True, linear_attention="qwen3_5", text_prefixes=("model.language_model.",)
    ),
    "Qwen3_5MoeForCausalLM": Family(qk_norm=True, moe="qwen", linear_attention="qwen3_5"),
    "Qwen3_5MoeForConditionalGeneration": Family(
        qk_norm=True,
        moe="qwen",
        linear_attention="qwen3_5",
        text_prefixes=("model.language_model.",),
    ),
}
assert set(FAMILIES) == set(ARCHITECTURES.values())


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str  # "linear" | "llama3" | "yarn" | "longrope"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # cos and sin are multiplied by it (yarn, longrope: transformers' attention_factor)
    attention_factor: float = 1.0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()
    # proportional (Gemma 4's global layers): the share of the head's dimensions rotated,
    # the others' frequencies zero
    rotary_fraction: float = 1.0


@dataclass(frozen=True, slots=True)
class Rope:
    theta: float
    scaling: RopeScaling | None = None


@dataclass(frozen=True, slots=True)
class SwiGLU:
    """gpt-oss's experts' activation: gate clamped above and up on both sides at `limit`,
    then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


@dataclass(frozen=True, slots=True)
class MoE:
    """A mixture-of-experts MLP: top-k of a softmax over the router's logits."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights are divided by their sum
    float32_weights: bool  # the weights stay float32 (Mixtral) or round to the model's dtype
    sparse_layers: tuple[bool, ...]  # which layers are MoE (the others are dense MLPs)
    shared_intermediate_size: int = 0  # a gated shared expert beside the routed ones (Qwen2-MoE)
    # gpt-oss: a softmax over the router's top k logits (not the top k of a softmax over
    # all), and the experts' clamped SwiGLU (its layout has biases: gpu_worker.moe)
    top_k_first: bool = False
    swiglu: SwiGLU | None = None  # None: the model's own activation
    # Gemma 4: the experts run beside the layer's dense MLP (not instead of it), routed
    # from the residual stream by a normed and scaled router, their weights scaled per expert
    beside_dense: bool = False


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """The Gated DeltaNet layers of Qwen3-Next and Qwen3.5 (gpu_worker.linear_attention)."""

    layers: tuple[bool, ...]  # which layers are linear attention (the others full)
    key_heads: int
    value_heads: int  # a multiple of key_heads: each key head serves value_heads / key_heads
    key_dim: int
    value_dim: int
    conv_kernel: int  # the short causal convolution's width

    @property
    def conv_dim(self) -> int:
        """The convolved channels: q, k and v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


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
    # The window every layer attends within (the largest, where they differ); None when a
    # layer sees the whole context. The service frees the blocks before it (Handshake).
    sliding_window: int | None = None
    # Each layer's window, None for full attention; () when no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    # The RoPE of the windowed layers where it differs from the others' (Gemma 3).
    sliding_rope: Rope | None = None
    # Whether each layer rotates its queries and keys (SmolLM3's NoPE layers do not);
    # () when every layer does.
    rope_layers: tuple[bool, ...] = ()
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    moe: MoE | None = None
    # The layer whose K/V each layer attends over: itself, or for Gemma 4's last
    # num_kv_shared_layers the last earlier layer of its kind, whose cache it reads
    # (allocating none); () when every layer has its own.
    kv_sources: tuple[int, ...] = ()
    # Gemma 4's per-layer inputs: the width of each layer's slice (0: none) and the
    # vocabulary of their embedding
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Each layer's MLP width where they differ (Gemma 4's double-wide shared-KV layers)
    layer_intermediate_sizes: tuple[int, ...] = ()
    # Each layer's own head_dim where they differ (Gemma 4's global layers: 512 beside the
    # sliding ones' 256); head_dim is then the largest, the cache's and the attention's,
    # and a narrower layer's heads are zero-padded to it (gpu_worker.model)
    layer_head_dims: tuple[int, ...] = ()
    # Each layer's own key/value heads where they differ (Gemma 4's global layers with
    # attention_k_eq_v); num_key_value_heads is then the most, the cache's, and a layer with
    # fewer repeats each of its heads to it (gpu_worker.model)
    layer_kv_heads: tuple[int, ...] = ()
    # Whether each layer's values are its keys' projection (Gemma 4's attention_k_eq_v on
    # the global layers: no v_proj); () when no layer's are
    keys_as_values: tuple[bool, ...] = ()
    # Qwen3-Next's and Qwen3.5's linear-attention layers; None for a model without them
    linear_attention: LinearAttention | None = None
    # The leading dims of each head that RoPE rotates (partial_rotary_factor), in pairs
    # (i, i + rotary_dim / 2) as transformers' apply_rotary_pos_emb; 0: the whole head
    rotary_dim: int = 0

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

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
        family = FAMILIES[architecture]
        if family.text_prefixes:
            raw = _text_config(raw)
        try:
            return cls._parse(raw, architecture)
        except UnsupportedModel as exc:  # named by the architecture it concerns
            raise UnsupportedModel(f"{architecture}: {exc}") from exc

    @classmethod
    def _parse(cls, raw: dict[str, Any], architecture: str) -> ModelConfig:
        family = FAMILIES[architecture]
        # "vision" (Gemma 4): bidirectional among an image's tokens alone, which the text
        # model served here never sees; causal for text
        if raw.get("use_bidirectional_attention") not in (None, False, "vision"):
            raise UnsupportedModel("bidirectional attention is not supported")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            partial = family.linear_attention is not None
            rope = _rope(raw, "full_attention", partial)
            windows = _layer_windows(raw, layers, family)
            sliding_rope = _rope(raw, "sliding_attention") if any(windows) else None
            config = cls(
                architecture=architecture,
                hidden_size=hidden,
                # Qwen3.5-MoE's config names none: every layer is a mixture of experts
                intermediate_size=int(
                    raw.get("intermediate_size")
                    or raw.get("moe_intermediate_size")
                    or raw["intermediate_size"]
                ),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope.theta,
                rope_scaling=rope.scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                vocab_size=int(raw["vocab_size"]),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.gemma)),
                attention_bias=family.qkv_bias
                or bool(raw.get("attention_bias", raw.get("qkv_bias", family.qkv_bias_default))),
                bos_token_id=_optional_int(raw.get("bos_token_id")),
                sliding_window=_common_window(windows),
                layer_windows=windows if any(windows) else (),
                sliding_rope=None if sliding_rope == rope else sliding_rope,
                rope_layers=_rope_layers(raw, layers, family),
                query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")),
                attn_logit_softcapping=_optional_float(raw.get("attn_logit_softcapping")),
                final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
                hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
                moe=_moe(raw, family, layers),
            )
            if family.gemma4:
                _add_gemma4(config, raw)
            if partial:
                _add_linear_attention(config, raw)
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
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModel(
                f"unsupported activation {self.hidden_act!r}; supported: silu, gelu_pytorch_tanh"
            )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def context_limit(self) -> int:
        """The longest sequence this model computes (windowed layers attend within their
        window; the others see the whole context)."""
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention layer (no KV: a recurrent state instead)."""
        linear = self.linear_attention
        return linear is not None and linear.layers[layer]

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V cache `layer` attends over (itself, unless it shares one)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def kv_heads_of(self, layer: int) -> int:
        """Layer `layer`'s own key/value heads (its k/v projections'), at most the cache's."""
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_key_value_heads

    def values_from_keys(self, layer: int) -> bool:
        return bool(self.keys_as_values) and self.keys_as_values[layer]

    def head_dim_of(self, layer: int) -> int:
        """Layer `layer`'s own head_dim (its q/k/v projections'), at most head_dim."""
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def intermediate_of(self, layer: int) -> int:
        """Layer `layer`'s MLP width."""
        if self.layer_intermediate_sizes:
            return self.layer_intermediate_sizes[layer]
        return self.intermediate_size

    def rope_of(self, layer: int) -> Rope | None:
        """The RoPE layer `layer` rotates its queries and keys with; None where it has none."""
        if self.rope_layers and not self.rope_layers[layer]:
            return None
        if self.sliding_rope is not None and self.window_of(layer):
            return self.sliding_rope
        return Rope(self.rope_theta, self.rope_scaling)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


# Families transformers has that cadence does not serve yet, by model_type and architecture
# name: what each lacks (issue 53), so that the refusal names it. None at present.
NOT_YET_SERVED: dict[str, str] = {}


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    if not names and raw.get("model_type") in ARCHITECTURES:
        names = [ARCHITECTURES[raw["model_type"]]]
    for name in names:
        if name in ARCHITECTURES.values():
            return name
    found = ", ".join(names) or f"model_type {raw.get('model_type')!r}"
    for name in [*names, raw.get("model_type")]:
        if name in NOT_YET_SERVED:
            raise UnsupportedModel(f"{found} is not served yet: it has {NOT_YET_SERVED[name]}")
    raise UnsupportedModel(
        f"unsupported architecture {found}; supported: {', '.join(ARCHITECTURES.values())}"
    )


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text model, as a config of its own."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json lacks the text model's text_config")
    inherited = {k: raw[k] for k in ("tie_word_embeddings", "bos_token_id") if k in raw}
    # the text config's own model_type where it names one (Gemma 4's), else Gemma 3's
    return {"model_type": "gemma3_text", **inherited, **text}


def _rope_dict(raw: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The RoPE parameters of one layer type.

    transformers >= 5 writes "rope_parameters" (rope_theta inside; per layer type for
    Gemma 3: "full_attention", "sliding_attention"); older ones "rope_scaling" beside a
    top-level rope_theta (and Gemma 3's rope_local_base_freq).
    """
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if not isinstance(value, dict):
            continue
        by_type = value.get(layer_type)
        if isinstance(by_type, dict):
            return by_type
        if any(isinstance(v, dict) for v in value.values()):
            return {}  # per layer type, and none for this one
        if layer_type == "sliding_attention" and "rope_local_base_freq" in raw:
            return {}  # an old Gemma 3 config: its scaling is the global layers'
        return value
    return {}


def _rope(raw: dict[str, Any], layer_type: str, partial: bool = False) -> Rope:
    """`partial`: the family rotates part of each head (ModelConfig.rotary_dim)."""
    rope = _rope_dict(raw, layer_type)
    theta = rope.get("rope_theta")
    if theta is None and layer_type == "sliding_attention":
        theta = raw.get("rope_local_base_freq")
    if theta is None:
        model_type = str(raw.get("model_type"))
        theta = raw.get("rope_theta") or DEFAULT_THETA.get((model_type, layer_type), 10000.0)
    return Rope(float(theta), _rope_scaling(raw, rope, partial))


def _rope_scaling(
    raw: dict[str, Any], rope: dict[str, Any], partial: bool = False
) -> RopeScaling | None:
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    fraction = float(rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)
    if fraction != 1 and rope_type != "proportional" and not partial:
        raise UnsupportedModel(
            "partial rotary embeddings (partial_rotary_factor) are not supported"
        )
    if rope_type == "default":
        return None
    if rope_type == "proportional":
        return RopeScaling(
            "proportional", float(rope.get("factor") or 1.0), rotary_fraction=fraction
        )
    longest = int(raw.get("max_position_embeddings", 2048))
    original = int(
        rope.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or longest
    )
    factor = float(rope.get("factor") or longest / original)
    if not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"rope scaling factor must be positive, got {factor}")
    if rope_type == "linear":
        return RopeScaling("linear", factor)
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            factor,
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    if rope_type == "yarn":
        return _yarn(rope, factor, original)
    return _longrope(rope, factor, original)


def _yarn(rope: dict[str, Any], factor: float, original: int) -> RopeScaling:
    # As transformers' _compute_yarn_parameters.
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
    )


def _longrope(rope: dict[str, Any], factor: float, original: int) -> RopeScaling:
    # As transformers' _compute_longrope_parameters.
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        short_factor=tuple(float(f) for f in rope["short_factor"]),
        long_factor=tuple(float(f) for f in rope["long_factor"]),
    )


def _common_window(windows: tuple[int | None, ...]) -> int | None:
    """The window every layer attends within (the largest); None when one sees all."""
    sizes = [w for w in windows if w]
    return max(sizes) if sizes and len(sizes) == len(windows) else None


def _layer_windows(raw: dict[str, Any], layers: int, family: Family) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers assigns them: by `layer_types` where
    the config lists them, else every layer (Mistral), the layers from max_window_layers
    on where use_sliding_window says so (Qwen2), or all but every n-th (Gemma)."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", not family.window_opt_in) or not window:
        return (None,) * layers
    types = raw.get("layer_types")
    if types is None and "use_sliding_window" in raw and "max_window_layers" in raw:
        first = int(raw["max_window_layers"])
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    pattern = int(raw.get("sliding_window_pattern") or family.window_pattern)
    if types is None and pattern:
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    if types is None:
        return (int(window),) * layers
    if len(types) != layers:
        raise ConfigError(f"layer_types lists {len(types)} layers, the model has {layers}")
    for kind in set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModel(f"unsupported layer type {kind!r}")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in types)


def _rope_layers(raw: dict[str, Any], layers: int, family: Family) -> tuple[bool, ...]:
    """Whether each layer has RoPE, as transformers' SmolLM3 config gives it: no_rope_layers
    (1: rotates, 0: NoPE) where the config lists them, else all but every n-th layer."""
    flags = raw.get("no_rope_layers")
    interval = int(raw.get("no_rope_layer_interval") or family.no_rope_interval)
    if flags is None and interval:
        flags = [(i + 1) % interval != 0 for i in range(layers)]
    if flags is None or all(flags):
        return ()
    if len(flags) != layers:
        raise ConfigError(f"no_rope_layers lists {len(flags)} layers, the model has {layers}")
    return tuple(bool(flag) for flag in flags)


def _moe(raw: dict[str, Any], family: Family, layers: int) -> MoE | None:
    if family.moe is None:
        return None
    if family.moe == "gemma4":
        if not raw.get("enable_moe_block"):
            return None
        return MoE(
            int(raw["num_experts"]),
            int(raw["top_k_experts"]),
            int(raw["moe_intermediate_size"]),
            renormalize=True,
            float32_weights=True,
            sparse_layers=(True,) * layers,
            beside_dense=True,
        )
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if family.moe == "gpt_oss":
        return MoE(
            experts,
            int(raw["num_experts_per_tok"]),
            int(raw["intermediate_size"]),
            renormalize=False,
            float32_weights=False,
            sparse_layers=(True,) * layers,
            top_k_first=True,
            swiglu=SwiGLU(
                float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0))
            ),
        )
    if family.moe == "mixtral":
        return MoE(
            experts,
            int(raw["num_experts_per_tok"]),
            int(raw["intermediate_size"]),
            renormalize=True,
            float32_weights=True,
            sparse_layers=(True,) * layers,
        )
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return MoE(
        experts,
        int(raw["num_experts_per_tok"]),
        int(raw["moe_intermediate_size"]),
        # Qwen3.5-MoE's router always renormalizes (its config has no norm_topk_prob)
        renormalize=bool(raw.get("norm_topk_prob", family.linear_attention is not None)),
        float32_weights=False,
        sparse_layers=tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)
        ),
        shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )


def _add_linear_attention(config: ModelConfig, raw: dict[str, Any]) -> None:
    """Qwen3-Next's and Qwen3.5's linear-attention layers (by layer_types, else every
    full_attention_interval-th layer full, as transformers' config), and the rotary
    dims of their full-attention layers."""
    layers = config.num_hidden_layers
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval") or 4)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    if len(types) != layers:
        raise ConfigError(f"layer_types lists {len(types)} layers, the model has {layers}")
    for kind in set(types) - {"linear_attention", "full_attention"}:
        raise UnsupportedModel(f"unsupported layer type {kind!r}")
    linear = LinearAttention(
        layers=tuple(kind == "linear_attention" for kind in types),
        key_heads=int(raw["linear_num_key_heads"]),
        value_heads=int(raw["linear_num_value_heads"]),
        key_dim=int(raw["linear_key_head_dim"]),
        value_dim=int(raw["linear_value_head_dim"]),
        conv_kernel=int(raw.get("linear_conv_kernel_dim") or 4),
    )
    if linear.value_heads % linear.key_heads:
        raise UnsupportedModel(
            f"{linear.value_heads} linear-attention value heads are not a multiple of "
            f"{linear.key_heads} key heads"
        )
    config.linear_attention = linear
    rope = _rope_dict(raw, "full_attention")
    fraction = float(rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)
    rotary = int(config.head_dim * fraction)
    if rotary % 2 or not 0 < rotary <= config.head_dim:
        raise UnsupportedModel(f"partial_rotary_factor {fraction} rotates {rotary} dims")
    config.rotary_dim = 0 if rotary == config.head_dim else rotary


def _add_gemma4(config: ModelConfig, raw: dict[str, Any]) -> None:
    """Gemma 4's per-layer inputs, its global layers' head_dim and k/v heads, keys as
    values, shared KV and double-wide MLPs, and its scores' scale of 1 (a
    query_pre_attn_scalar of 1)."""
    layers = config.num_hidden_layers
    overrides = _gemma4_overrides(config, raw)
    dims = tuple(int(overrides.get(i, {}).get("head_dim", config.head_dim)) for i in range(layers))
    config.head_dim = max(dims)
    if len(set(dims)) > 1:
        config.layer_head_dims = dims
    kv_heads = tuple(
        int(overrides.get(i, {}).get("num_key_value_heads", config.num_key_value_heads))
        for i in range(layers)
    )
    config.num_key_value_heads = max(kv_heads)
    if any(config.num_key_value_heads % n for n in kv_heads):
        raise UnsupportedModel(
            f"Gemma 4's key/value heads {sorted(set(kv_heads))} do not divide one another"
        )
    if len(set(kv_heads)) > 1:
        config.layer_kv_heads = kv_heads
    if raw.get("attention_k_eq_v"):
        config.keys_as_values = tuple(window is None for window in config.layer_windows) or (
            (True,) * layers
        )
    config.query_pre_attn_scalar = 1.0
    config.per_layer_input_size = int(raw.get("hidden_size_per_layer_input") or 0)
    config.per_layer_vocab_size = int(raw.get("vocab_size_per_layer_input") or config.vocab_size)
    shared = int(raw.get("num_kv_shared_layers") or 0)
    if not shared:
        return
    windows = config.layer_windows or (None,) * layers
    first_shared = layers - shared
    owners = {windows[i]: i for i in range(first_shared)}  # each kind's last owner
    if set(windows[first_shared:]) - set(owners):
        raise ConfigError("a layer shares the KV of a kind of layer that no earlier layer has")
    config.kv_sources = tuple(i if i < first_shared else owners[windows[i]] for i in range(layers))
    if raw.get("use_double_wide_mlp"):
        wide = 2 * config.intermediate_size
        config.layer_intermediate_sizes = tuple(
            config.intermediate_size if i < first_shared else wide for i in range(layers)
        )


def _gemma4_overrides(config: ModelConfig, raw: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each global layer's overrides, as transformers' Gemma4TextConfig makes them: the
    per_layer_config it writes (by layer index), else a head_dim of global_head_dim (512
    where the config names none) and, with attention_k_eq_v, num_global_key_value_heads."""
    if "per_layer_config" in raw:
        written = raw.get("per_layer_config") or {}
        return {int(layer): dict(override) for layer, override in written.items()}
    override: dict[str, Any] = {"head_dim": int(raw.get("global_head_dim") or 512)}
    if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads"):
        override["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
    windows = config.layer_windows or (None,) * config.num_hidden_layers
    return {i: override for i, window in enumerate(windows) if window is None}
