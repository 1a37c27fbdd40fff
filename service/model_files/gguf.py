"""Convert a llama.cpp GGUF file into a Hugging Face style Llama directory.

Every tensor is dequantized once here (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and whatever else
the `gguf` package can dequantize), renamed to the Hugging Face Llama names, and written as
float32 safetensors: dequantized values are exact in float32, so the worker may cast them
to its own dtype without a second rounding. The tokenizer is rebuilt from the
`tokenizer.ggml.*` metadata as a `tokenizers` tokenizer.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from gpu_worker.protocol import ARCHITECTURES

CONVERTIBLE = ("llama",)  # the GGUF architectures this converter maps onto ARCHITECTURES

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Tokens that end a turn in the chat formats of the common GGUF models; llama.cpp treats
# them as end-of-generation too, whatever the file's eos id says.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^(\w+)\.(weight|bias)$")


class GGUFError(ValueError):
    """The file is not a GGUF this converter can turn into a Llama directory."""


@dataclass(slots=True)
class _Heads:
    num_heads: int
    num_kv_heads: int


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors, tokenizer files into `out_dir` (must exist)."""
    reader = _open(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in CONVERTIBLE:
        raise GGUFError(
            f"architecture {arch!r} is not supported (supported: {', '.join(CONVERTIBLE)})"
        )
    tokenizer, special = build_tokenizer(meta)
    tensors = convert_tensors(reader, meta)
    config = hf_config(meta, tensors, special, _rope_freqs(reader))
    out_dir = Path(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta, special))


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


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"GGUF metadata lacks {key!r}")
    return meta[key]


def _heads(meta: dict[str, Any]) -> _Heads:
    num_heads = int(_require(meta, "llama.attention.head_count"))
    return _Heads(num_heads, int(meta.get("llama.attention.head_count_kv", num_heads)))


# ---- tensors -------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a llama.cpp tensor name; GGUFError if unknown."""
    if match := _LAYER_NAME.match(gguf_name):
        layer, part, kind = match.groups()
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    elif (match := _GLOBAL_NAME.match(gguf_name)) and match.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match.group(1)]}.{match.group(2)}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


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


def convert_tensors(reader: gguf.GGUFReader, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    heads = _heads(meta)
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into config.json's rope_scaling by _rope_scaling
        name = hf_tensor_name(tensor.name)
        values = dequantize(tensor)
        if ".attn_q." in tensor.name:
            values = unpermute_rope_rows(values, heads.num_heads)
        elif ".attn_k." in tensor.name:
            values = unpermute_rope_rows(values, heads.num_kv_heads)
        out[name] = values
    if "model.embed_tokens.weight" not in out:
        raise GGUFError("GGUF has no token_embd.weight tensor")
    return out


def _rope_freqs(reader: gguf.GGUFReader) -> np.ndarray | None:
    found = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    return dequantize(found[0]).reshape(-1) if found else None


# ---- config --------------------------------------------------------------------------------


def hf_config(
    meta: dict[str, Any],
    tensors: dict[str, np.ndarray],
    special: _SpecialTokens,
    rope_freqs: np.ndarray | None = None,
) -> dict[str, Any]:
    heads = _heads(meta)
    hidden = int(_require(meta, "llama.embedding_length"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads.num_heads))
    num_layers = int(_require(meta, "llama.block_count"))
    found_layers = {k.split(".")[2] for k in tensors if k.startswith("model.layers.")}
    if len(found_layers) != num_layers:
        raise GGUFError(
            f"GGUF declares {num_layers} layers but holds tensors for {len(found_layers)}"
        )
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES["llama"]],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, "llama.feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads.num_heads,
        "num_key_value_heads": heads.num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, head_dim, rope_freqs),
        "vocab_size": int(vocab_size),
        "hidden_act": "silu",
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": special.bos_id,
        "eos_token_id": special.eos_ids[0] if len(special.eos_ids) == 1 else special.eos_ids,
        "torch_dtype": "float32",
    }
    return config


def _rope_scaling(
    meta: dict[str, Any], head_dim: int, rope_freqs: np.ndarray | None
) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type", "none")
    factor = float(meta.get("llama.rope.scaling.factor", 1.0))
    original = meta.get("llama.rope.scaling.original_context_length")
    if rope_freqs is not None:
        return _llama3_rope_scaling(meta, head_dim, rope_freqs)
    if kind in ("none", "") or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and original:
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise GGUFError(f"rope scaling {kind!r} is not supported")


def _llama3_rope_scaling(
    meta: dict[str, Any], head_dim: int, rope_freqs: np.ndarray
) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1 style scaling only as per-frequency factors: recover the
    published parameters and accept them only if they reproduce those factors."""
    stored = rope_freqs.astype(np.float64)
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    params = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_factors(params, theta, head_dim), stored, rtol=1e-3):
        raise GGUFError("rope_freqs tensor does not match Llama 3 rope scaling; not supported")
    return params


def _llama3_factors(params: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    low_wavelen = params["original_max_position_embeddings"] / params["low_freq_factor"]
    high_wavelen = params["original_max_position_embeddings"] / params["high_freq_factor"]
    smooth = (params["original_max_position_embeddings"] / wavelen - params["low_freq_factor"]) / (
        params["high_freq_factor"] - params["low_freq_factor"]
    )
    mid = 1.0 / ((1 - smooth) / params["factor"] + smooth)
    return np.where(
        wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, params["factor"], mid)
    )


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}


# ---- tokenizer -----------------------------------------------------------------------------


@dataclass(slots=True)
class _SpecialTokens:
    tokens: list[str]
    bos_id: int | None
    eos_ids: list[int]

    def text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def build_tokenizer(meta: dict[str, Any]) -> tuple[HFTokenizer, _SpecialTokens]:
    """A `tokenizers` tokenizer from the tokenizer.ggml.* metadata (byte-level BPE only)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
        )
    tokens = list(_require(meta, "tokenizer.ggml.tokens"))
    token_types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _require(meta, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    control = [
        t for t, kind in zip(tokens, token_types, strict=True) if kind == _TOKEN_TYPE_CONTROL
    ]
    user = [
        t for t, kind in zip(tokens, token_types, strict=True) if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    special = _special_tokens(meta, tokens, set(control))
    if _adds_bos(meta, special):
        bos = special.text(special.bos_id)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, special.bos_id)]
        )
    return tokenizer, special


def _adds_bos(meta: dict[str, Any], special: _SpecialTokens) -> bool:
    """Whether encoding with special tokens prepends BOS. A "BOS" that the chat template
    writes literally is a turn marker (SmolLM2's GGUF names <|im_start|>), not a sequence
    start, so it is not prepended, as in the model's own tokenizer.json."""
    if not meta.get("tokenizer.ggml.add_bos_token", False) or special.bos_id is None:
        return False
    return special.text(special.bos_id) not in (meta.get("tokenizer.chat_template") or "")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit alone, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    splits = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
    if pre in splits:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(splits[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise GGUFError(
        f"GGUF pre-tokenizer {pre!r} is not supported "
        f"(supported: default, gpt2, smollm, {', '.join(splits)})"
    )


def _special_tokens(meta: dict[str, Any], tokens: list[str], control: set[str]) -> _SpecialTokens:
    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    bos_id = token_id("bos_token_id")
    eos_ids: list[int] = []
    template = meta.get("tokenizer.chat_template") or ""
    # The chat template's own end-of-turn token first: it is what an instruct model emits.
    ordered = sorted(_END_OF_TURN_TOKENS, key=lambda t: t not in template)
    for text in ordered:
        if text in control:
            eos_ids.append(tokens.index(text))
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        candidate = token_id(key)
        # Some converters write the bos id as eos (SmolLM2's GGUF does); that would stop
        # generation at the start of a turn rather than at its end.
        if candidate is not None and candidate != bos_id and candidate not in eos_ids:
            eos_ids.append(candidate)
    if not eos_ids:
        fallback = token_id("eos_token_id")
        if fallback is None:
            raise GGUFError("GGUF names no end-of-sequence token")
        eos_ids.append(fallback)
    return _SpecialTokens(tokens=tokens, bos_id=bos_id, eos_ids=eos_ids)


def _tokenizer_config(meta: dict[str, Any], special: _SpecialTokens) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special.text(special.bos_id),
        "eos_token": special.text(special.eos_ids[0]),
        "add_bos_token": _adds_bos(meta, special),
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
