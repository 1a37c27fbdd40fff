"""Qwen3-Next's and Qwen3.5's linear-attention tensors as their checkpoints hold them.

llama.cpp's converter (Qwen3NextModel, and _LinearAttentionVReorderBase for Qwen3.5) stores
A as -exp(A_log), conv1d squeezed to [channels, kernel], dt_bias as the bias of ssm_dt, and
every norm but the gated one as w + 1; Qwen3-Next's in_proj_qkvz is split into all q, k, v
rows (attn_qkv) and z (attn_gate); Qwen3.5's value heads are reordered from grouped by key
head to tiled (for ggml's broadcast). Each is undone here, on the renamed tensors; A_log
comes back within an ulp (exp then log), the rest exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from service.model_files.gguf_arch import Meta

Tensors = dict[str, np.ndarray]


def qwen3_next_tensors(tensors: Tensors, meta: Meta) -> Tensors:
    """in_proj_qkvz put back together, then the fixes both families share."""
    key_heads, key_dim = _key_heads(meta)
    out: Tensors = {}
    for name, values in tensors.items():
        if name.endswith(".linear_attn.in_proj_qkv.weight"):
            gate = tensors[name.replace("in_proj_qkv", "in_proj_z")]
            fused = name.replace("in_proj_qkv", "in_proj_qkvz")
            out[fused] = _qkvz_rows(values, gate, key_heads, key_dim)
        elif not name.endswith(".linear_attn.in_proj_z.weight"):
            out[name] = values
    return _shared_fixes(out)


def qwen3_5_tensors(tensors: Tensors, meta: Meta) -> Tensors:
    """The value heads grouped by key head again, then the fixes both families share."""
    key_heads, key_dim = _key_heads(meta)
    value_dim = int(meta.require("ssm.inner_size")) // int(meta.require("ssm.time_step_rank"))
    qk_rows = 2 * key_heads * key_dim
    out: Tensors = {}
    for name, values in tensors.items():
        part = name.removeprefix("model.layers.").split(".", 1)[-1]
        if part in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
            v = _grouped(values[qk_rows:], 0, key_heads, value_dim)
            out[name] = np.concatenate([values[:qk_rows], v])
        elif part == "linear_attn.in_proj_z.weight":
            out[name] = _grouped(values, 0, key_heads, value_dim)
        elif part == "linear_attn.out_proj.weight":
            out[name] = _grouped(values, 1, key_heads, value_dim)
        elif part in _PER_VALUE_HEAD:
            out[name] = _grouped(values, 0, key_heads, 1)
        else:
            out[name] = values
    return _shared_fixes(out)


_PER_VALUE_HEAD = (
    "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.A_log",
    "linear_attn.dt_proj.bias",
)


def _key_heads(meta: Meta) -> tuple[int, int]:
    return int(meta.require("ssm.group_count")), int(meta.require("ssm.state_size"))


def _shared_fixes(tensors: Tensors) -> Tensors:
    out: Tensors = {}
    for name, values in tensors.items():
        if name.endswith(".linear_attn.A_log"):
            out[name] = np.log(-values)
        elif name.endswith(".linear_attn.conv1d.weight"):
            out[name] = np.ascontiguousarray(values[:, None, :])
        elif name.endswith(".linear_attn.dt_proj.bias"):
            out[name.replace("dt_proj.bias", "dt_bias")] = values
        elif name.endswith("norm.weight") and not name.endswith(".linear_attn.norm.weight"):
            out[name] = values - np.float32(1.0)  # exact where w + 1 lies in [0.5, 2]
        else:
            out[name] = values
    return out


def _qkvz_rows(qkv: np.ndarray, z: np.ndarray, key_heads: int, key_dim: int) -> np.ndarray:
    """[q of every head, k of every head, v of every head] and z's rows, back into
    in_proj_qkvz's [q, k, v, z] per key head."""
    q, k, v = np.split(qkv, [key_heads * key_dim, 2 * key_heads * key_dim])
    per_head = [a.reshape(key_heads, -1, a.shape[-1]) for a in (q, k, v, z)]
    return np.ascontiguousarray(np.concatenate(per_head, axis=1).reshape(-1, qkv.shape[-1]))


def _grouped(values: np.ndarray, axis: int, key_heads: int, head_dim: int) -> np.ndarray:
    """Value heads along `axis` from llama.cpp's tiled order ([per key, key, head_dim]) back
    to grouped by key head ([key, per key, head_dim])."""
    moved = np.moveaxis(values, axis, 0)
    tiled = moved.reshape(-1, key_heads, head_dim, *moved.shape[1:])
    grouped = tiled.swapaxes(0, 1).reshape(moved.shape)
    return np.ascontiguousarray(np.moveaxis(grouped, 0, axis))
