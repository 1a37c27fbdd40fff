"""GGUF conversion of every architecture the converter maps, checked against transformers.

Each tiny model is a random transformers model written to a GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes it (its tensor names from the `gguf` package's own map, q/k rows
permuted for llama-arch files, Gemma's norms as w + 1, experts stacked, and each newer
family's own reshaping as llama.cpp's conversion/ modules do it: gpt-oss's experts split and
MXFP4, Qwen3-Next's and Qwen3.5's linear-attention tensors). Where the format itself loses a
bit (MXFP4, w + 1, -exp(A_log)), the tiny model's values are ones it keeps exactly. cadence's
conversion must then give back that model: the same logits, and where transformers reads the
architecture's GGUF files itself, the config and the state dict of transformers' own load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from safetensors.numpy import load_file

from gpu_worker.protocol import QUANTIZED_WEIGHTS
from service.model_files.gguf import GGUFError, convert_gguf, gguf_model_type
from tests.test_model_files_gguf import (
    _add_tensor,
    add_sizes,
    finish,
    permute_like_llama_cpp,
    tiny_vocab,
)
from tests.worker_fixtures import generate_greedy, make_runner

TOKENS, TOKEN_TYPES = tiny_vocab()
MERGES = ["Ġ t", "h e", "Ġt he"]
IDS = [1, 40, 80, 120, 200, 250, 262, 3, 17, 99, 150, 2, 33, 7, 210, 64, 5, 270]
SMALL = {
    "vocab_size": len(TOKENS),
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}


@dataclass
class Case:
    """One architecture: its transformers model and how llama.cpp writes it."""

    gguf_arch: str
    model_class: Callable[..., Any]
    config: dict[str, Any]
    permuted: bool = False  # llama.cpp's LlamaModel.permute
    norm_shift: float = 0.0
    unshifted_norms: tuple[str, ...] = ()  # norms llama.cpp stores as they are
    head_dim_keys: bool = False  # llama.cpp writes attention.key_length / value_length
    metadata: Callable[[gguf.GGUFWriter, Any], None] = lambda writer, config: None
    name: str = "tiny"
    experts: dict[str, str] = field(default_factory=dict)  # HF part -> GGUF stacked part
    transformers_reads_it: bool = True  # transformers' own GGUF loader knows the layout
    transformers_config: bool = True  # and builds the same kind of config
    # llama.cpp's own reshaping of a checkpoint's tensors, for names the map does not know
    reshape: Callable[[str, np.ndarray], dict[str, np.ndarray]] | None = None
    experts_type: Q | None = None  # the stacked experts' type, whatever the others'
    # a multi-token prediction layer after the model's, as llama.cpp adds Qwen3.5's
    draft_layer: bool = False


def _gemma3_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_sliding_window(config.sliding_window)


def _gemma2_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_sliding_window(config.sliding_window)
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _phi3_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_sliding_window(config.sliding_window or 0)


def _phi3_longrope(writer: gguf.GGUFWriter, config: Any) -> None:
    _phi3_metadata(writer, config)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    rope = config.rope_parameters
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


def _mistral_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_sliding_window(config.sliding_window)


def _moe_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if hasattr(config, "moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if hasattr(config, "shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _gpt_oss_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    _moe_metadata(writer, config)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _gpt_oss_reshape(hf_name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
    """GptOssModel.modify_tensors: gate_up split (gate the even columns), experts
    transposed to [experts, out, in], sinks given a .weight."""
    if not hf_name.startswith("model.layers."):
        return {}
    block = "blk." + hf_name.split(".")[2]
    part = hf_name.rsplit(".", 1)[1]
    if part == "gate_up_proj":
        return {
            f"{block}.ffn_gate_exps.weight": weight[..., ::2].swapaxes(1, 2).copy(),
            f"{block}.ffn_up_exps.weight": weight[..., 1::2].swapaxes(1, 2).copy(),
        }
    if part == "gate_up_proj_bias":
        return {
            f"{block}.ffn_gate_exps.bias": weight[..., ::2].copy(),
            f"{block}.ffn_up_exps.bias": weight[..., 1::2].copy(),
        }
    if part == "down_proj":
        return {f"{block}.ffn_down_exps.weight": weight.swapaxes(1, 2).copy()}
    if part == "down_proj_bias":
        return {f"{block}.ffn_down_exps.bias": weight}
    if part == "sinks":
        return {f"{block}.attn_sinks.weight": weight}
    return {}


def _qwen3_next_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    if hasattr(config, "num_experts"):
        _moe_metadata(writer, config)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(4)
    rotary = config.rope_parameters["partial_rotary_factor"]
    writer.add_rope_dimension_count(int(config.head_dim * rotary))


def _qwen3_5_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    _qwen3_next_metadata(writer, config)
    writer.add_rope_dimension_sections([11, 11, 10, 0])  # _Qwen35MRopeMixin's default


def _qwen3_next_reshape(hf_name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3NextModel.modify_tensors: A as -exp(A_log), conv1d squeezed, dt_bias as
    ssm_dt.bias, in_proj_qkvz's rows regrouped into attn_qkv and attn_gate."""
    if not hf_name.startswith("model.layers."):
        return {}
    block = "blk." + hf_name.split(".")[2]
    if hf_name.endswith(".A_log"):
        return {f"{block}.ssm_a": -np.exp(weight)}
    if hf_name.endswith(".dt_bias"):
        return {f"{block}.ssm_dt.bias": weight}
    if hf_name.endswith("conv1d.weight"):
        return {f"{block}.ssm_conv1d.weight": weight.squeeze()}
    if hf_name.endswith("in_proj_qkvz.weight"):
        heads, key_dim = LINEAR_HEADS["linear_num_key_heads"], LINEAR_HEADS["linear_key_head_dim"]
        per_head = weight.reshape(heads, -1, weight.shape[-1])
        value_dim = (per_head.shape[1] - 2 * key_dim) // 2
        q, k, v, z = np.split(per_head, np.cumsum([key_dim, key_dim, value_dim]), axis=1)
        flat = [a.reshape(-1, weight.shape[-1]) for a in (q, k, v, z)]
        return {
            f"{block}.attn_qkv.weight": np.concatenate(flat[:3]),
            f"{block}.attn_gate.weight": flat[3],
        }
    return {}


LINEAR_HEADS = {  # the linear-attention layers' heads in the Qwen3-Next and Qwen3.5 cases
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}


def _tiled(values: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head
    ([key, per key, head_dim]) to tiled ([per key, key, head_dim]) along `axis`."""
    keys = LINEAR_HEADS["linear_num_key_heads"]
    moved = np.moveaxis(values, axis, 0)
    grouped = moved.reshape(keys, -1, head_dim, *moved.shape[1:])
    return np.moveaxis(grouped.swapaxes(0, 1).reshape(moved.shape), 0, axis).copy()


def _qwen3_5_reshape(hf_name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3_5TextModel.modify_tensors: the value heads tiled, then Qwen3-Next's fixes."""
    if ".linear_attn." not in hf_name:
        return {}
    block = "blk." + hf_name.split(".")[2]
    value_dim = LINEAR_HEADS["linear_value_head_dim"]
    qk_rows = 2 * LINEAR_HEADS["linear_num_key_heads"] * LINEAR_HEADS["linear_key_head_dim"]
    part = hf_name.split(".linear_attn.")[1]
    if part == "in_proj_qkv.weight":
        v = _tiled(weight[qk_rows:], 0, value_dim)
        return {f"{block}.attn_qkv.weight": np.concatenate([weight[:qk_rows], v])}
    if part == "conv1d.weight":
        squeezed = weight.squeeze()
        v = _tiled(squeezed[qk_rows:], 0, value_dim)
        return {f"{block}.ssm_conv1d.weight": np.concatenate([squeezed[:qk_rows], v])}
    if part == "out_proj.weight":
        return {f"{block}.ssm_out.weight": _tiled(weight, 1, value_dim)}
    gguf_part = {
        "in_proj_z.weight": ("attn_gate.weight", value_dim),
        "in_proj_b.weight": ("ssm_beta.weight", 1),
        "in_proj_a.weight": ("ssm_alpha.weight", 1),
        "A_log": ("ssm_a", 1),
        "dt_bias": ("ssm_dt.bias", 1),
    }.get(part)
    if gguf_part is None:
        return {}
    tiled = _tiled(weight, 0, gguf_part[1])
    return {f"{block}.{gguf_part[0]}": -np.exp(tiled) if part == "A_log" else tiled}


MIXTRAL_EXPERTS = {"w1": "ffn_gate_exps", "w2": "ffn_down_exps", "w3": "ffn_up_exps"}
QWEN_EXPERTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
HALF_HEAD = 8  # longrope: one factor per rotary frequency (head_dim 16)

CASES = {
    "qwen35": Case(
        "qwen35",
        transformers.Qwen3_5ForCausalLM,
        {"num_hidden_layers": 4, "head_dim": 16, **LINEAR_HEADS},
        norm_shift=1.0,
        unshifted_norms=("linear_attn.norm.weight",),
        head_dim_keys=True,
        metadata=_qwen3_5_metadata,
        transformers_reads_it=False,  # its loader knows no qwen35 files
        reshape=_qwen3_5_reshape,
    ),
    "qwen35-with-mtp": Case(
        "qwen35",
        transformers.Qwen3_5ForCausalLM,
        {"num_hidden_layers": 4, "head_dim": 16, **LINEAR_HEADS},
        norm_shift=1.0,
        unshifted_norms=("linear_attn.norm.weight",),
        head_dim_keys=True,
        metadata=_qwen3_5_metadata,
        transformers_reads_it=False,
        reshape=_qwen3_5_reshape,
        draft_layer=True,  # left out: the causal model has none
    ),
    "qwen35moe": Case(
        "qwen35moe",
        transformers.Qwen3_5MoeForCausalLM,
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            **LINEAR_HEADS,
        },
        norm_shift=1.0,
        unshifted_norms=("linear_attn.norm.weight",),
        head_dim_keys=True,
        metadata=_qwen3_5_metadata,
        experts=QWEN_EXPERTS,
        transformers_reads_it=False,  # its loader knows no qwen35moe files
        reshape=_qwen3_5_reshape,
    ),
    "qwen3next": Case(
        "qwen3next",
        transformers.Qwen3NextForCausalLM,
        {
            "num_hidden_layers": 4,  # three linear-attention layers, then a full one
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            **LINEAR_HEADS,
        },
        norm_shift=1.0,  # its norms are 1 + w, stored as 1 + w but for the gated one
        unshifted_norms=("linear_attn.norm.weight",),
        head_dim_keys=True,
        metadata=_qwen3_next_metadata,
        experts=QWEN_EXPERTS,
        transformers_reads_it=False,  # its loader knows no qwen3next files
        reshape=_qwen3_next_reshape,
    ),
    "gpt-oss": Case(
        "gpt-oss",
        transformers.GptOssForCausalLM,
        {
            "intermediate_size": 32,  # one MXFP4 block per down_proj row
            "head_dim": 16,
            "num_hidden_layers": 3,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
        head_dim_keys=True,
        metadata=_gpt_oss_metadata,
        transformers_reads_it=False,  # its loader knows no gpt-oss files
        reshape=_gpt_oss_reshape,
        experts_type=Q.MXFP4,  # as llama.cpp repacks the checkpoint's own MXFP4
    ),
    "smollm3": Case(
        "smollm3",
        transformers.SmolLM3ForCausalLM,
        {"num_hidden_layers": 4, "head_dim": 16},  # the fourth layer has no RoPE
        permuted=True,
        transformers_reads_it=False,  # its loader knows no smollm3 files
    ),
    "qwen2": Case("qwen2", transformers.Qwen2ForCausalLM, {"rope_theta": 1e6}),
    "qwen3": Case("qwen3", transformers.Qwen3ForCausalLM, {"head_dim": 24}, head_dim_keys=True),
    "gemma3": Case(
        "gemma3",
        transformers.Gemma3ForCausalLM,
        {
            **SMALL,
            "num_hidden_layers": 7,
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512,
        },
        norm_shift=1.0,
        head_dim_keys=True,
        metadata=_gemma3_metadata,
    ),
    "gemma2": Case(
        "gemma2",
        transformers.Gemma2ForCausalLM,
        {
            **SMALL,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 5.0,  # small enough to bend these tiny logits
            "final_logit_softcapping": 3.0,
            "rms_norm_eps": 1e-6,
        },
        norm_shift=1.0,
        head_dim_keys=True,
        metadata=_gemma2_metadata,
    ),
    "phi3": Case(
        "phi3",
        transformers.Phi3ForCausalLM,
        {"sliding_window": 32, "original_max_position_embeddings": 256},
        metadata=_phi3_metadata,
    ),
    "phi3-longrope": Case(
        "phi3",
        transformers.Phi3ForCausalLM,
        {
            "max_position_embeddings": 1024,
            "original_max_position_embeddings": 128,
            "rope_scaling": {
                "rope_type": "longrope",
                "long_factor": [1.0 + 0.5 * i for i in range(HALF_HEAD)],
                "short_factor": [1.0 + 0.1 * i for i in range(HALF_HEAD)],
            },
        },
        metadata=_phi3_longrope,
        transformers_reads_it=False,  # its loader drops the longrope factors
    ),
    "mistral": Case(
        "llama",
        transformers.MistralForCausalLM,
        {"sliding_window": 4096, "head_dim": 16},
        permuted=True,
        metadata=_mistral_metadata,
        name="Mistral tiny",
        # transformers reads a llama-arch Mistral file as Llama: the same tensors, no window.
        transformers_config=False,
    ),
    "mixtral": Case(
        "llama",
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16},
        permuted=True,
        metadata=_moe_metadata,
        experts=MIXTRAL_EXPERTS,
        transformers_reads_it=False,  # its loader reads a llama-arch Mixtral as Llama
    ),
    "qwen2moe": Case(
        "qwen2moe",
        transformers.Qwen2MoeForCausalLM,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
        metadata=_moe_metadata,
        experts=QWEN_EXPERTS,
    ),
    "qwen3moe": Case(
        "qwen3moe",
        transformers.Qwen3MoeForCausalLM,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "head_dim": 16,
            "norm_topk_prob": True,
        },
        head_dim_keys=True,
        metadata=_moe_metadata,
        experts=QWEN_EXPERTS,
    ),
}


def tiny_model(case: Case, seed: int = 0) -> Any:
    config_class = case.model_class.config_class
    config = config_class(**{**SMALL, **case.config})
    torch.manual_seed(seed)
    model = case.model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms multiply by 1 + w: keep both kinds near 1.
                param.copy_(case.norm_shift * -0.9 + 1.0 + 0.1 * torch.randn_like(param))
                if case.norm_shift:  # on a grid where w + 1 is exact, as real norms are
                    param.copy_(torch.round(param * 4096) / 4096)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)  # an uneven routing
            else:
                param.normal_(0.0, 0.1)
            if name.endswith("A_log"):
                param.copy_(_exp_log_fixed_point(param))
            if case.experts_type is not None and name.endswith(("gate_up_proj", "down_proj")):
                param.copy_(_on_grid(param, case.experts_type))
    return model


def _exp_log_fixed_point(a_log: torch.Tensor) -> torch.Tensor:
    """Values that come back from llama.cpp's -exp(A_log) bit for bit (log of exp in float32
    loses an ulp of most values), so the file holds the model exactly."""
    values = a_log.numpy()
    for _ in range(4):
        values = np.log(np.exp(values))
    assert np.array_equal(np.log(np.exp(values)), values)
    return torch.from_numpy(values)


def _on_grid(fused: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Fused [experts, in, out] weights rounded to `qtype`'s values, whose blocks run along
    `in` (so the file holds the model's weights exactly)."""
    rows = fused.transpose(1, 2).numpy()
    rounded = gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype)
    return torch.from_numpy(np.ascontiguousarray(rounded)).transpose(1, 2)


def checkpoint(model: Any, tmp_path: Path) -> dict[str, np.ndarray]:
    """The model's tensors as its Hugging Face checkpoint names them (one per expert)."""
    directory = tmp_path / "original"
    model.save_pretrained(directory)
    return load_file(str(directory / "model.safetensors"))


def write_gguf(path: Path, case: Case, model: Any, tmp_path: Path, qtype: Q = Q.F32) -> None:
    config = model.config
    writer = gguf.GGUFWriter(str(path), case.gguf_arch)
    writer.add_name(case.name)
    add_sizes(writer, config)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if case.head_dim_keys:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    case.metadata(writer, config)
    if case.draft_layer:
        writer.add_block_count(config.num_hidden_layers + 1)
        writer.add_nextn_predict_layers(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    for name, weight in gguf_tensors(case, model, tmp_path).items():
        # llama.cpp too leaves rows that fill no block (Qwen3.5's conv1d) unquantized
        kind = Q.F32 if weight.ndim == 1 or weight.shape[-1] % 32 else qtype
        if case.experts_type is not None and name.endswith("_exps.weight"):
            kind = case.experts_type
        _add_tensor(writer, name, weight, kind)
    finish(writer)


def gguf_tensors(case: Case, model: Any, tmp_path: Path) -> dict[str, np.ndarray]:
    config = model.config
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == case.gguf_arch)
    names = gguf.get_tensor_name_map(arch, 99)
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, weight in checkpoint(model, tmp_path).items():
        weight = weight.astype(np.float32)
        if case.permuted and ".q_proj." in hf_name:
            weight = permute_like_llama_cpp(weight, config.num_attention_heads)
        elif case.permuted and ".k_proj." in hf_name:
            weight = permute_like_llama_cpp(weight, config.num_key_value_heads)
        if hf_name.endswith("norm.weight") and not hf_name.endswith(case.unshifted_norms):
            weight = weight + np.float32(case.norm_shift)
        if case.reshape is not None and (reshaped := case.reshape(hf_name, weight)):
            out.update(reshaped)
            continue
        if ".experts." in hf_name:
            parts = hf_name.split(".")
            layer, expert, part = parts[2], int(parts[-3]), parts[-2]
            stacks.setdefault(f"blk.{layer}.{case.experts[part]}.weight", {})[expert] = weight
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        out[gguf_name] = weight.reshape(-1) if "shared_expert_gate" in hf_name else weight
    for name, by_expert in stacks.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out | (_draft_layer(out, config) if case.draft_layer else {})


def _draft_layer(tensors: dict[str, np.ndarray], config: Any) -> dict[str, np.ndarray]:
    """_QwenMtpMixin's layer after the model's: a full-attention layer (the last one's
    tensors here) and the nextn projection and norms."""
    last, draft = config.num_hidden_layers - 1, config.num_hidden_layers
    hidden = config.hidden_size
    layer = {
        name.replace(f"blk.{last}.", f"blk.{draft}."): weight
        for name, weight in tensors.items()
        if name.startswith(f"blk.{last}.")
    }
    nextn = {
        "eh_proj.weight": np.ones((hidden, 2 * hidden), np.float32),
        "enorm.weight": np.ones(hidden, np.float32),
        "hnorm.weight": np.ones(hidden, np.float32),
        "shared_head_norm.weight": np.ones(hidden, np.float32),
    }
    return layer | {f"blk.{draft}.nextn.{name}": weight for name, weight in nextn.items()}


def converted(case_name: str, tmp_path: Path, qtype: Q = Q.F32) -> tuple[Any, Path, Path]:
    case = CASES[case_name]
    model = tiny_model(case)
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, case, model, tmp_path, qtype)
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(gguf_path, out)
    return model, gguf_path, out


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


# Fields transformers' GGUF loader does not read from a file (it keeps its class defaults
# where llama.cpp reads the file or its own rule); the logits test above shows cadence's.
NOT_READ_BY_TRANSFORMERS = {
    "eos_token_id",  # cadence lists the end-of-turn tokens too; see test_model_files_gguf
    "sliding_window",  # Phi-3's: llama.cpp reads attention.sliding_window
    "original_max_position_embeddings",  # Phi-3's: rope.scaling.original_context_length
    "head_dim",  # Qwen3's attention.key_length
    "moe_intermediate_size",  # the MoE files' expert_feed_forward_length
    "shared_expert_intermediate_size",  # Qwen2-MoE's expert_shared_feed_forward_length
    "attn_logit_softcapping",  # Gemma 2's (llama.cpp reads them)
    "final_logit_softcapping",
    "query_pre_attn_scalar",  # Gemma 3's: llama.cpp's rule (head_dim; hidden/heads in 27B)
    "unk_token_id",  # a tokenizer's: tokenizer_config.json's unk_token
    "_model_name_or_path",  # transformers' is general.name
    "_name_or_path",
    "dtype",
    "transformers_version",
    "architectures",
}


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_converted_model_is_the_original(tmp_path: Path, case_name: str) -> None:
    model, _, out = converted(case_name, tmp_path)
    mine = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["model_type"] == model.config.model_type
    # One tensor per expert, as the model's own checkpoint names them.
    assert set(load_file(str(out / "model.safetensors"))) == set(checkpoint(model, tmp_path))
    want = model.state_dict()
    for name, tensor in mine.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=1e-7, msg=name)
    ids = IDS * 3  # past the tiny sliding windows
    torch.testing.assert_close(logits(mine, ids), logits(model, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "case_name", sorted(name for name, case in CASES.items() if case.transformers_reads_it)
)
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_config_and_weights_equal_transformers_gguf_load(
    tmp_path: Path, case_name: str, qtype: Q
) -> None:
    _, gguf_path, out = converted(case_name, tmp_path, qtype)
    reference_config, reference_tensors = transformers_gguf_load(gguf_path)
    mine = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    if CASES[case_name].transformers_config:
        assert type(mine).config_class is type(reference_config)
        got, want = mine.config.to_dict(), reference_config.to_dict()
        differing = {
            k: (got.get(k), want.get(k))
            for k in set(got) | set(want)
            if k not in NOT_READ_BY_TRANSFORMERS and got.get(k) != want.get(k)
        }
        assert not differing
    state = mine.state_dict()
    tied = {"lm_head.weight"} if mine.config.tie_word_embeddings else set()
    assert set(reference_tensors) == set(state) - tied
    for name, tensor in reference_tensors.items():
        assert torch.equal(state[name], tensor.float()), name


def transformers_gguf_load(gguf_path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' own reading of a GGUF file: its config, and its state dict (the loader
    from_pretrained(gguf_file=...) calls, without the accelerate package it also wants)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):  # only its parameter names are read
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    return config, parsed["tensors"]


@pytest.mark.parametrize("case_name", ["gpt-oss", "qwen35"])
def test_the_worker_serves_the_converted_model(tmp_path: Path, case_name: str) -> None:
    """The newest families' conversions through cadence's worker: transformers' greedy
    continuation of the original model."""
    model, _, out = converted(case_name, tmp_path)
    with torch.no_grad():
        want = model.generate(torch.tensor([IDS]), max_new_tokens=8, do_sample=False)
    assert generate_greedy(make_runner(out), IDS, 8) == want[0, len(IDS) :].tolist()


def test_matmul_weights_rearranged_by_cadence_are_listed_unserved(tmp_path: Path) -> None:
    """Qwen3.5's out_proj (its columns in llama.cpp's value-head order) and its gated
    attention's q_proj (queries and gates, split by the worker at load) are not repacked for
    --quantization gguf, which then refuses the model naming them; the others are repacked."""
    _, _, out = converted("qwen35", tmp_path, Q.Q8_0)
    with safe_open(str(out / QUANTIZED_WEIGHTS), framework="np") as handle:
        unserved = handle.metadata()["unserved"]
        repacked = set(handle.keys())
    linear_layers = range(3)
    assert {entry + ")" for entry in unserved.removesuffix(")").split("), ")} == {
        *(
            f"model.layers.{i}.linear_attn.out_proj.weight (Q8_0, rearranged by cadence)"
            for i in linear_layers
        ),
        "model.layers.3.self_attn.q_proj.weight (Q8_0, rearranged by cadence)",
    }
    assert "model.layers.3.self_attn.o_proj.weight.values" in repacked
    assert not any("linear_attn" in name for name in repacked)


def test_gemma4_file_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "gemma4.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    finish(writer)
    with pytest.raises(GGUFError, match=r"'gemma4'.*per-layer input embeddings"):
        gguf_model_type(path)
    with pytest.raises(GGUFError, match="'gemma4'"):
        convert_gguf(path, tmp_path)
