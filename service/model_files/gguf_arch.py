"""What differs between the GGUF architectures the converter maps onto Hugging Face models.

For each: the Hugging Face model type and class it becomes, the names of its tensors in a
Hugging Face checkpoint (as the model's own repository spells them, one tensor per expert),
the fixes llama.cpp's convert_hf_to_gguf.py applied that must be undone (the q/k row order of
llama-arch files, Gemma's norms stored as w + 1, gpt-oss's experts split and transposed, the
linear-attention tensors of gguf_linear_attention), and its config.json fields. The keys are
llama.cpp's (`{arch}.embedding_length`, ...); missing ones take the defaults llama.cpp uses.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.model_files.gguf_linear_attention import qwen3_5_tensors, qwen3_next_tensors
from service.model_files.gguf_meta import GGUFError, require

_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp derives from config fields; they go back into config.json.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

Config = dict[str, Any]
Tensors = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class Arch:
    """One Hugging Face architecture as a GGUF file stores it."""

    model_type: str
    hf_class: str
    layer_tensors: dict[str, str]  # GGUF name part -> the module's path inside a layer
    # A stacked [experts, out, in] GGUF tensor -> each expert's path ({e}: its index).
    expert_tensors: dict[str, str] = field(default_factory=dict)
    permuted_qk: bool = False  # llama.cpp's LlamaModel.permute reordered q/k rows
    norm_shift: float = 0.0  # llama.cpp stored every norm weight as w + norm_shift
    fields: Callable[[Meta], Config] = lambda meta: {}
    omit: tuple[str, ...] = ()  # common config fields this architecture's config lacks
    # The renamed tensors put together as the Hugging Face checkpoint holds them (experts
    # fused into one tensor, names without .weight).
    assemble: Callable[[Tensors, Meta], Tensors] = lambda tensors, meta: tensors
    # GGUF matmul weights (name parts) that assemble rearranges: listed unserved, not repacked
    rearranged_parts: tuple[str, ...] = ()


class Meta:
    """The metadata of one file, read by llama.cpp's key names for its architecture."""

    def __init__(self, meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        self.raw = meta
        self.arch = str(meta.get("general.architecture"))
        self.tensors = tensors  # Hugging Face names, and CONFIG_TENSORS by their GGUF names

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        return require(self.raw, f"{self.arch}.{key}")

    @property
    def num_layers(self) -> int:
        """The model's layers: llama.cpp counts Qwen3-Next's and Qwen3.5's multi-token
        prediction layers (nextn_predict_layers, after the model's) among its blocks."""
        return int(self.require("block_count")) - int(self.get("nextn_predict_layers", 0) or 0)

    def is_draft_layer(self, gguf_name: str) -> bool:
        """Whether a tensor belongs to a multi-token prediction layer (a Hugging Face causal
        model has none: it is left out)."""
        match = _LAYER_INDEX.match(gguf_name)
        return match is not None and int(match.group(1)) >= self.num_layers

    @property
    def num_heads(self) -> int:
        return int(self.require("attention.head_count"))

    @property
    def num_kv_heads(self) -> int:
        return int(self.get("attention.head_count_kv", self.num_heads))

    @property
    def head_dim(self) -> int:
        hidden = int(self.require("embedding_length"))
        return int(self.get("attention.key_length", hidden // self.num_heads))

    @property
    def sliding_window(self) -> int | None:
        window = int(self.get("attention.sliding_window", 0) or 0)
        return window or None


def _llama(meta: Meta) -> Config:
    return {"mlp_bias": False}


def _smollm3(meta: Meta) -> Config:
    # llama.cpp's smollm3 leaves RoPE out of every fourth layer, whatever the file says.
    layers = meta.num_layers
    no_rope = [int((i + 1) % SMOLLM3_NO_ROPE_INTERVAL != 0) for i in range(layers)]
    return {
        **_llama(meta),
        "no_rope_layers": no_rope,
        "no_rope_layer_interval": SMOLLM3_NO_ROPE_INTERVAL,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _mistral(meta: Meta) -> Config:
    return {"sliding_window": meta.sliding_window}


def _mixtral(meta: Meta) -> Config:
    return {**_mistral(meta), **_experts(meta, "num_local_experts")}


def _experts(meta: Meta, count_name: str) -> Config:
    return {
        count_name: int(meta.require("expert_count")),
        "num_experts_per_tok": int(meta.require("expert_used_count")),
    }


def _qwen2(meta: Meta) -> Config:
    # llama.cpp runs Qwen2 and Qwen3 without a window; a window with use_sliding_window
    # false would be read as one by a loader that ignores the flag.
    return {"use_sliding_window": False, "sliding_window": None}


def _qwen_moe(meta: Meta) -> Config:
    return {
        **_qwen2(meta),
        **_experts(meta, "num_experts"),
        "moe_intermediate_size": int(meta.require("expert_feed_forward_length")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _qwen2_moe(meta: Meta) -> Config:
    shared = int(meta.require("expert_shared_feed_forward_length"))
    return _qwen_moe(meta) | {
        "shared_expert_intermediate_size": shared,
        # llama.cpp's qwen2moe weighs the chosen experts by their softmax as is.
        "norm_topk_prob": False,
        "qkv_bias": "model.layers.0.self_attn.q_proj.bias" in meta.tensors,
    }


def _qwen3_moe(meta: Meta) -> Config:
    # llama.cpp's qwen3moe renormalizes the chosen experts' weights (as transformers' own
    # GGUF loader assumes too).
    return _qwen_moe(meta) | {"norm_topk_prob": True}


def _gpt_oss(meta: Meta) -> Config:
    # llama.cpp's openai-moe: a window on every other layer from the first, the clamped
    # SwiGLU's constants built in, YaRN without truncating its correction range.
    layers = meta.num_layers
    rope = rope_scaling(meta)
    return {
        **_experts(meta, "num_local_experts"),
        "intermediate_size": int(meta.require("expert_feed_forward_length")),
        "sliding_window": meta.sliding_window,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "rope_scaling": rope | {"truncate": False} if rope else None,
    }


def _gpt_oss_tensors(tensors: Tensors, meta: Meta) -> Tensors:
    """gpt-oss's experts as its checkpoint holds them: gate and up interleaved column by
    column in one [experts, hidden, 2 * intermediate] gate_up_proj, down_proj as
    [experts, intermediate, hidden] (llama.cpp split and transposed them); sinks bare."""
    out: Tensors = {}
    for name, values in tensors.items():
        if name.endswith(".self_attn.sinks.weight"):
            out[name.removesuffix(".weight")] = values
        elif name.endswith(".mlp.experts.down_proj.weight"):
            out[name.removesuffix(".weight")] = np.ascontiguousarray(values.swapaxes(1, 2))
        elif name.endswith(".mlp.experts.down_proj.bias"):
            out[name.replace("down_proj.bias", "down_proj_bias")] = values
        elif ".mlp.experts.gate_proj." in name:
            up = tensors[name.replace("gate_proj", "up_proj")]
            both = np.stack([values, up], axis=-2 if values.ndim == 3 else -1)
            if name.endswith(".weight"):  # [E, I, 2, H] -> [E, H, 2I]
                gate_up = both.reshape(values.shape[0], -1, values.shape[2]).swapaxes(1, 2)
                out[name.replace("gate_proj.weight", "gate_up_proj")] = np.ascontiguousarray(
                    gate_up
                )
            else:  # [E, I, 2] -> [E, 2I]
                out[name.replace("gate_proj.bias", "gate_up_proj_bias")] = both.reshape(
                    values.shape[0], -1
                )
        elif ".mlp.experts.up_proj." not in name:
            out[name] = values
    return out


def _gated_deltanet(meta: Meta) -> Config:
    """The linear-attention layers' fields (Qwen3-Next, Qwen3.5), from llama.cpp's ssm keys."""
    layers = meta.num_layers
    # llama.cpp's rule: every interval-th layer is full attention, the others linear.
    interval = int(meta.get("full_attention_interval", 4))
    value_heads = int(meta.require("ssm.time_step_rank"))
    return {
        "linear_conv_kernel_dim": int(meta.require("ssm.conv_kernel")),
        "linear_key_head_dim": int(meta.require("ssm.state_size")),
        "linear_num_key_heads": int(meta.require("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(meta.require("ssm.inner_size")) // value_heads,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        "partial_rotary_factor": int(meta.require("rope.dimension_count")) / meta.head_dim,
    }


def _qwen3_next(meta: Meta) -> Config:
    config = _qwen2_moe(meta) | _gated_deltanet(meta) | {"norm_topk_prob": True}
    config["full_attention_interval"] = int(meta.get("full_attention_interval", 4))
    config.pop("qkv_bias")
    return config


def _qwen3_5(meta: Meta) -> Config:
    # Its interleaved multimodal RoPE is plain RoPE for text (one position per token).
    return _qwen2(meta) | _gated_deltanet(meta)


def _qwen3_5_moe(meta: Meta) -> Config:
    return _qwen3_5(meta) | {
        **_experts(meta, "num_experts"),
        "moe_intermediate_size": int(meta.require("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(meta.require("expert_shared_feed_forward_length")),
    }


def _gemma2(meta: Meta) -> Config:
    # llama.cpp's defaults: a 4096-token window on every other layer, logits soft-capped.
    attn_cap = float(meta.get("attn_logit_softcapping", 50.0))
    return _gemma(meta, period=2, layers_27b=46, window=meta.sliding_window or 4096) | {
        "attn_logit_softcapping": attn_cap,
        "final_logit_softcapping": float(meta.get("final_logit_softcapping", 30.0)),
    }


def _gemma3(meta: Meta) -> Config:
    softcap = meta.get("final_logit_softcapping")
    return _gemma(meta, period=6, layers_27b=62, window=meta.sliding_window) | {
        "rope_local_base_freq": float(meta.get("rope.freq_base_swa", 10000.0)),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": float(softcap) if softcap else None,
    }


def _gemma(meta: Meta, period: int, layers_27b: int, window: int | None) -> Config:
    layers = meta.num_layers
    hidden = int(meta.require("embedding_length"))
    sliding = _gemma_sliding_layers(meta, layers, period) if window else [False] * layers
    # llama.cpp (and gemma_pytorch) scale queries by 1/sqrt(hidden/heads) in the 27B
    # models, by 1/sqrt(head_dim) in the others.
    scalar = hidden // meta.num_heads if layers == layers_27b else meta.head_dim
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attention_bias": False,
    }


def _gemma_sliding_layers(meta: Meta, layers: int, period: int) -> list[bool]:
    """Which layers attend in the window: llama.cpp's sliding_window_pattern, a per-layer
    list or a period n whose last layer is global (the architecture's when absent)."""
    pattern = meta.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"sliding_window_pattern lists {len(pattern)} of {layers} layers")
        return [bool(p) for p in pattern]
    period = int(pattern)
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def _phi3(meta: Meta) -> Config:
    context = int(meta.get("context_length", 4096))
    original = int(meta.get("rope.scaling.original_context_length", context))
    config: Config = {
        "original_max_position_embeddings": original,
        "sliding_window": meta.sliding_window,
    }
    rotary = meta.get("rope.dimension_count")
    if rotary is not None and int(rotary) != meta.head_dim:
        config["partial_rotary_factor"] = int(rotary) / meta.head_dim
    long, short = (meta.tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if long is not None and short is not None:
        config["rope_scaling"] = {
            "type": "longrope",
            "rope_type": "longrope",
            "long_factor": [float(x) for x in long.reshape(-1)],
            "short_factor": [float(x) for x in short.reshape(-1)],
        }
    return config


_DENSE = _ATTENTION | _MLP
LLAMA = Arch("llama", "LlamaForCausalLM", _DENSE, permuted_qk=True, fields=_llama)
SMOLLM3_NO_ROPE_INTERVAL = 4
SMOLLM3 = Arch("smollm3", "SmolLM3ForCausalLM", _DENSE, permuted_qk=True, fields=_smollm3)
MISTRAL = Arch("mistral", "MistralForCausalLM", _DENSE, permuted_qk=True, fields=_mistral)
MIXTRAL = Arch(
    "mixtral",
    "MixtralForCausalLM",
    _ATTENTION | {"ffn_gate_inp": "block_sparse_moe.gate"},
    {
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    },
    permuted_qk=True,
    fields=_mixtral,
)
# Qwen2 always has q/k/v biases, and its head size is hidden / heads.
QWEN2 = Arch(
    "qwen2", "Qwen2ForCausalLM", _DENSE, fields=_qwen2, omit=("attention_bias", "head_dim")
)
QWEN3 = Arch("qwen3", "Qwen3ForCausalLM", _DENSE | _QK_NORM, fields=_qwen2)
_QWEN_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
QWEN2_MOE = Arch(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    _ATTENTION
    | {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # [1, hidden]; GGUF drops the 1
    },
    _QWEN_EXPERTS,
    fields=_qwen2_moe,
    omit=("attention_bias", "head_dim"),
)
QWEN3_MOE = Arch(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    _ATTENTION | _QK_NORM | {"ffn_gate_inp": "mlp.gate"},
    _QWEN_EXPERTS,
    fields=_qwen3_moe,
)
# Experts stay stacked here ([experts, out, in], as llama.cpp stores them), fused after.
GPT_OSS = Arch(
    "gpt_oss",
    "GptOssForCausalLM",
    _ATTENTION
    | {
        "attn_sinks": "self_attn.sinks",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
    fields=_gpt_oss,
    assemble=_gpt_oss_tensors,
)
# Qwen3-Next and Qwen3.5: three Gated DeltaNet layers to each full-attention layer.
_LINEAR_ATTENTION = _QK_NORM | {
    "post_attention_norm": "post_attention_layernorm",
    "ssm_a": "linear_attn.A_log",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
}
QWEN3_NEXT = Arch(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    QWEN2_MOE.layer_tensors | _LINEAR_ATTENTION | {"ssm_ba": "linear_attn.in_proj_ba"},
    _QWEN_EXPERTS,
    fields=_qwen3_next,
    assemble=qwen3_next_tensors,  # what it rearranges the worker serves dense
    rearranged_parts=("attn_q",),  # the gated attention's q_proj: the worker splits it
)
_QWEN3_5_LINEAR = _LINEAR_ATTENTION | {
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
}
# The one matmul weight of those whose value heads llama.cpp reordered (its columns) that
# --quantization gguf would serve quantized (the in-projections are served dense), and the
# gated attention's q_proj, whose queries and gates the worker splits at load.
_QWEN3_5_REARRANGED = ("ssm_out", "attn_q")
QWEN3_5 = Arch(
    "qwen3_5_text",
    "Qwen3_5ForCausalLM",
    _DENSE | _QWEN3_5_LINEAR,
    fields=_qwen3_5,
    assemble=qwen3_5_tensors,
    rearranged_parts=_QWEN3_5_REARRANGED,
)
QWEN3_5_MOE = Arch(
    "qwen3_5_moe_text",
    "Qwen3_5MoeForCausalLM",
    QWEN2_MOE.layer_tensors | _QWEN3_5_LINEAR,
    _QWEN_EXPERTS,
    fields=_qwen3_5_moe,
    assemble=qwen3_5_tensors,
    rearranged_parts=_QWEN3_5_REARRANGED,
)
_GEMMA_LAYER = _DENSE | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA2 = Arch(
    "gemma2",
    "Gemma2ForCausalLM",
    _GEMMA_LAYER,
    norm_shift=1.0,
    fields=_gemma2,
    omit=("hidden_act",),  # hidden_activation
)
GEMMA3 = Arch(
    "gemma3_text",
    "Gemma3ForCausalLM",
    _GEMMA_LAYER | _QK_NORM,
    norm_shift=1.0,
    fields=_gemma3,
    omit=("hidden_act",),
)
PHI3 = Arch(
    "phi3",
    "Phi3ForCausalLM",
    {
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    fields=_phi3,
    omit=("attention_bias",),
)
# GGUF general.architecture -> what it may become (llama-arch files hold three kinds).
CONVERTIBLE: dict[str, tuple[Arch, ...]] = {
    "llama": (LLAMA, MISTRAL, MIXTRAL),
    "qwen2": (QWEN2,),
    "qwen3": (QWEN3,),
    "qwen2moe": (QWEN2_MOE,),
    "qwen3moe": (QWEN3_MOE,),
    "gemma2": (GEMMA2,),
    "gemma3": (GEMMA3,),
    "phi3": (PHI3,),
    "smollm3": (SMOLLM3,),
    "gpt-oss": (GPT_OSS,),
    "qwen3next": (QWEN3_NEXT,),
    "qwen35": (QWEN3_5,),
    "qwen35moe": (QWEN3_5_MOE,),
}


# GGUF architectures the worker serves from Hugging Face files but whose GGUF files are not
# converted: what their files hold that is not mapped back.
NOT_CONVERTED = {
    "gemma4": (
        "Gemma 4's files are not converted: their per-layer head sizes and KV head counts, "
        "the KV shared across layers, the per-layer input embeddings and the router's "
        "scales are not mapped back to Gemma4ForCausalLM (serve its Hugging Face checkpoint)"
    ),
}


def select_arch(meta: dict[str, Any], tensor_names: list[str]) -> Arch:
    """The architecture a file holds; GGUFError naming it if it is none of CONVERTIBLE."""
    arch = meta.get("general.architecture")
    if arch in NOT_CONVERTED:
        raise GGUFError(f"architecture {arch!r}: {NOT_CONVERTED[arch]}")
    if arch not in CONVERTIBLE:
        raise GGUFError(
            f"architecture {arch!r} is not supported (supported: {', '.join(CONVERTIBLE)})"
        )
    if arch != "llama":
        return CONVERTIBLE[arch][0]
    # llama.cpp writes Mistral and Mixtral as llama; transformers takes a "mistral" in the
    # name for Mistral, and the experts' tensors say Mixtral.
    if any(name.endswith("_exps.weight") for name in tensor_names):
        return MIXTRAL
    name = str(meta.get("general.name") or "").lower()
    if meta.get("llama.attention.sliding_window") or "mistral" in name:
        return MISTRAL
    return LLAMA


_LAYER_INDEX = re.compile(r"^blk\.(\d+)\.")
# A few (Qwen3-Next's ssm_a) have no .weight, as their checkpoint names have none.
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+?)(\.weight|\.bias)?$")
_GLOBAL_NAME = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_names(arch: Arch, gguf_name: str, experts: int = 0) -> list[str]:
    """The Hugging Face names of a llama.cpp tensor (one per expert for a stacked expert
    tensor); GGUFError if the architecture has no such tensor."""
    if match := _LAYER_NAME.match(gguf_name):
        layer, part, kind = match.groups()
        kind = kind or ""
        if part in arch.layer_tensors:
            return [f"model.layers.{layer}.{arch.layer_tensors[part]}{kind}"]
        if part in arch.expert_tensors and experts:
            path = arch.expert_tensors[part]
            return [f"model.layers.{layer}.{path.format(e=e)}{kind}" for e in range(experts)]
    elif (match := _GLOBAL_NAME.match(gguf_name)) and match.group(1) in GLOBAL_TENSORS:
        return [f"{GLOBAL_TENSORS[match.group(1)]}.{match.group(2)}"]
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no {arch.hf_class} counterpart")


def hf_config(arch: Arch, meta: Meta, bos_id: int | None, eos_ids: list[int]) -> Config:
    """config.json: the fields every architecture has, then the architecture's own."""
    tensors = meta.tensors
    num_layers = meta.num_layers
    found_layers = {k.split(".")[2] for k in tensors if k.startswith("model.layers.")}
    if len(found_layers) != num_layers:
        raise GGUFError(
            f"GGUF declares {num_layers} layers but holds tensors for {len(found_layers)}"
        )
    pad = meta.raw.get("tokenizer.ggml.padding_token_id")
    config: Config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": int(meta.require("embedding_length")),
        "intermediate_size": _intermediate_size(arch, meta),
        "num_hidden_layers": num_layers,
        "num_attention_heads": meta.num_heads,
        "num_key_value_heads": meta.num_kv_heads,
        "head_dim": meta.head_dim,
        "max_position_embeddings": int(meta.get("context_length", 2048)),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(meta),
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_act": "silu",
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": int(pad) if pad is not None else None,
        "torch_dtype": "float32",
    }
    config.update(arch.fields(meta))
    return {k: v for k, v in config.items() if k not in arch.omit}


def _intermediate_size(arch: Arch, meta: Meta) -> int:
    if arch.expert_tensors and meta.get("feed_forward_length") is None:
        return int(meta.require("expert_feed_forward_length"))
    return int(meta.require("feed_forward_length"))


def rope_scaling(meta: Meta) -> Config | None:
    kind = meta.get("rope.scaling.type", "none")
    factor = float(meta.get("rope.scaling.factor", 1.0))
    original = meta.get("rope.scaling.original_context_length")
    if meta.tensors.get("rope_freqs.weight") is not None:
        return _llama3_rope_scaling(meta, meta.tensors["rope_freqs.weight"].reshape(-1))
    if kind in ("none", "", "longrope") or factor == 1.0:
        return None  # longrope: the factors are tensors, read by the architecture (Phi-3)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and original:
        scaling = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(original),
        }
        for key, name in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
            if (value := meta.get(f"rope.scaling.yarn_{key}")) is not None:
                scaling[name] = float(value)
        return scaling
    raise GGUFError(f"rope scaling {kind!r} is not supported")


def _llama3_rope_scaling(meta: Meta, stored_factors: np.ndarray) -> Config:
    """llama.cpp stores Llama 3.1 style scaling only as per-frequency factors: recover the
    published parameters and accept them only if they reproduce those factors."""
    stored = stored_factors.astype(np.float64)
    theta = float(meta.get("rope.freq_base", 10000.0))
    params = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_factors(params, theta, meta.head_dim), stored, rtol=1e-3):
        raise GGUFError("rope_freqs tensor does not match Llama 3 rope scaling; not supported")
    return params


def _llama3_factors(params: Config, theta: float, head_dim: int) -> np.ndarray:
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    original = params["original_max_position_embeddings"]
    low_wavelen = original / params["low_freq_factor"]
    high_wavelen = original / params["high_freq_factor"]
    smooth = (original / wavelen - params["low_freq_factor"]) / (
        params["high_freq_factor"] - params["low_freq_factor"]
    )
    mid = 1.0 / ((1 - smooth) / params["factor"] + smooth)
    return np.where(
        wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, params["factor"], mid)
    )
