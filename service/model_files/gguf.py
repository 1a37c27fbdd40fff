"""Convert a llama.cpp GGUF file into a Hugging Face style model directory.

Every tensor is dequantized once here (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants and
whatever else the `gguf` package can dequantize), renamed to the Hugging Face names of its
architecture (gguf_arch), and written as float32 safetensors: dequantized values are exact
in float32, so the worker may cast them to its own dtype without a second rounding. The
tokenizer is rebuilt from the `tokenizer.ggml.*` metadata as a `tokenizers` tokenizer.json
(gguf_tokenizer).

The matmul weights are also written as the file quantized them, repacked without loss
(gguf_quants) into quantized.safetensors (gpu_worker.protocol.QUANTIZED_WEIGHTS), which the
worker serves under --quantization gguf; its metadata names the matmul weights of a type no
kernel serves ("unserved"), which that setting then refuses. A conversion records its
CONVERSION_VERSION: the cache converts again a file converted by an older one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file

from gpu_worker.protocol import QUANTIZED_WEIGHTS
from service.model_files.gguf_arch import (
    CONFIG_TENSORS,
    CONVERTIBLE,
    LLAMA,
    Arch,
    Meta,
    hf_config,
    hf_tensor_names,
    select_arch,
)
from service.model_files.gguf_meta import GGUFError
from service.model_files.gguf_quants import FLOAT_TYPES, REPACKERS, Repacked, repack
from service.model_files.gguf_tokenizer import build_tokenizer, tokenizer_config

__all__ = [
    "CONVERSION_VERSION",
    "CONVERTIBLE",
    "GGUFError",
    "convert_gguf",
    "gguf_model_type",
    "hf_tensor_name",
]

# 2: quantized.safetensors beside model.safetensors; 3: Q5 types as 5-bit codes (uint8)
CONVERSION_VERSION = 3
VERSION_FILE = "conversion.json"
# The Hugging Face weights the worker's dense layers multiply by (a mixture's experts and
# the norms are not among them)
MATMULS = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors, tokenizer files into `out_dir` (must exist)."""
    reader = _open(gguf_path)
    meta = _metadata(reader)
    arch = select_arch(meta, [t.name for t in reader.tensors])
    tokenizer, special = build_tokenizer(meta)
    tensors = convert_tensors(reader, meta, arch)
    config = hf_config(arch, Meta(meta, tensors), special.bos_id, special.eos_ids)
    for name in CONFIG_TENSORS:
        tensors.pop(name, None)
    out_dir = Path(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    quantized, unserved = quantized_tensors(reader, meta, arch)
    metadata = {"format": "pt", "unserved": ", ".join(unserved)}
    save_file(quantized, str(out_dir / QUANTIZED_WEIGHTS), metadata=metadata)
    _write_json(out_dir / VERSION_FILE, {"version": CONVERSION_VERSION})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    context = int(config["max_position_embeddings"])
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, special, context))


def gguf_model_type(gguf_path: Path) -> str:
    """The Hugging Face model_type a GGUF file converts to, read from its header only."""
    reader = _open(gguf_path)
    return select_arch(_metadata(reader), [t.name for t in reader.tensors]).model_type


def _open(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise GGUFError(f"not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as exc:
            raise GGUFError(f"GGUF metadata {key!r} is unreadable: {exc}") from exc
    return meta


# ---- tensors -------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str, arch: Arch = LLAMA) -> str:
    """The Hugging Face name of a llama.cpp tensor name; GGUFError if unknown."""
    names = hf_tensor_names(arch, gguf_name)
    return names[0]


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it reorders each head for interleaved RoPE)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GGUFError(f"q/k tensor of {rows} rows does not split into {num_heads} heads")
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weight.shape))


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """The tensor as float32 in Hugging Face layout ([out_features, in_features])."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GGUFError(
            f"tensor {tensor.name!r}: quantization {tensor.tensor_type.name} is not supported"
        ) from exc
    values = np.asarray(values, dtype=np.float32)
    if values.size != int(np.prod(shape)):
        raise GGUFError(f"tensor {tensor.name!r}: data does not match its shape {shape}")
    return values.reshape(shape)


def convert_tensors(
    reader: gguf.GGUFReader, meta: dict[str, Any], arch: Arch
) -> dict[str, np.ndarray]:
    """Every tensor under its Hugging Face name(s), with llama.cpp's fixes undone; the
    tensors that stand for config fields keep their GGUF names (CONFIG_TENSORS)."""
    view = Meta(meta, {})
    experts = int(view.get("expert_count", 0) or 0)
    out: dict[str, np.ndarray] = {}
    for tensor in [t for t in reader.tensors if not view.is_draft_layer(t.name)]:
        values = dequantize(tensor)
        if tensor.name in CONFIG_TENSORS:
            out[tensor.name] = values.reshape(-1)
            continue
        names = hf_tensor_names(arch, tensor.name, experts)
        if arch.permuted_qk and ".attn_q." in tensor.name:
            values = unpermute_rope_rows(values, view.num_heads)
        elif arch.permuted_qk and ".attn_k." in tensor.name:
            values = unpermute_rope_rows(values, view.num_kv_heads)
        if arch.norm_shift and tensor.name.endswith("norm.weight"):
            values = values - np.float32(arch.norm_shift)
        if tensor.name.endswith(".ffn_gate_inp_shexp.weight") and values.ndim == 1:
            values = values[None, :]
        if len(names) == 1:
            out[names[0]] = values
        elif values.ndim != 3 or values.shape[0] != len(names):
            raise GGUFError(
                f"tensor {tensor.name!r} of shape {values.shape} is not {experts} experts"
            )
        else:
            out.update(
                {name: np.ascontiguousarray(v) for name, v in zip(names, values, strict=True)}
            )
    if "model.embed_tokens.weight" not in out:
        raise GGUFError("GGUF has no token_embd.weight tensor")
    return arch.assemble(out, view)


def quantized_tensors(
    reader: gguf.GGUFReader, meta: dict[str, Any], arch: Arch
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The matmul weights in their own quantized types, repacked, as <name>.values,
    <name>.scales and <name>.mins; and the names (with types) of those of a type no kernel
    serves. Float tensors are neither: they are served dense."""
    view = Meta(meta, {})
    out: dict[str, np.ndarray] = {}
    unserved = []
    kept = [t for t in reader.tensors if not view.is_draft_layer(t.name)]
    for tensor in [t for t in kept if t.name not in CONFIG_TENSORS]:
        names = hf_tensor_names(arch, tensor.name, int(view.get("expert_count", 0) or 0))
        matmul = len(names) == 1 and names[0].endswith(MATMULS) and ".experts." not in names[0]
        if not matmul or tensor.tensor_type in FLOAT_TYPES:
            continue
        if any(f".{part}." in tensor.name for part in arch.rearranged_parts):
            unserved.append(f"{names[0]} ({tensor.tensor_type.name}, rearranged by cadence)")
            continue
        if tensor.tensor_type not in REPACKERS:
            unserved.append(f"{names[0]} ({tensor.tensor_type.name})")
            continue
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))
        weight = repack(tensor.data, tensor.tensor_type, shape)
        weight = _unpermuted(weight, tensor.name, arch, view)
        out[names[0] + ".values"], out[names[0] + ".scales"] = weight.values, weight.scales
        if weight.mins is not None:
            out[names[0] + ".mins"] = weight.mins
    return out, unserved


def _unpermuted(weight: Repacked, gguf_name: str, arch: Arch, view: Meta) -> Repacked:
    """llama.cpp's q/k row order undone, as convert_tensors undoes it."""
    if arch.permuted_qk and ".attn_q." in gguf_name:
        return weight.rows_permuted(lambda a: unpermute_rope_rows(a, view.num_heads))
    if arch.permuted_qk and ".attn_k." in gguf_name:
        return weight.rows_permuted(lambda a: unpermute_rope_rows(a, view.num_kv_heads))
    return weight


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
