"""GGUF -> Hugging Face directory conversion, checked against tiny GGUF files written here
from a random transformers Llama (the way llama.cpp's converter writes them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from service.model_files.gguf import GGUFError, convert_gguf, hf_tensor_name, unpermute_rope_rows
from service.model_files.resolve import ModelFileError, resolve_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "i n",
    "Ġ a",
    "e r",
    "o n",
    "Ġ w",
    "o r",
    "Ġw or",
    "l d",
    "Ġwor ld",
]
# Digit merges that SmolLM's pre-tokenizer must never apply (it splits every digit alone).
DIGIT_MERGES = ["2 0", "1 2"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Control tokens, the 256 byte symbols, the merged tokens, one user-defined token."""
    byte_symbols = list(bytes_to_unicode().values())
    merged = [m.replace(" ", "") for m in MERGES + DIGIT_MERGES]
    tokens = SPECIALS + byte_symbols + merged + USER_DEFINED
    types = [3] * len(SPECIALS) + [1] * (len(byte_symbols) + len(merged)) + [4]
    return tokens, types


def tiny_llama(*, tied: bool, seed: int = 0) -> LlamaForCausalLM:
    tokens, _ = tiny_vocab()
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model


def permute_like_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, *part, kind = hf_name.split(".")
    return f"blk.{layer}.{LAYER_PARTS['.'.join(part)]}.{kind}"


def hf_weights(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_tiny_gguf(
    path: Path,
    model: LlamaForCausalLM,
    qtype: Q,
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> None:
    config = model.config
    tokens, types = tiny_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    add_sizes(writer, config)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES + DIGIT_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    if extra is not None:
        extra(writer)
    for name, weight in hf_weights(model).items():
        if name.endswith("q_proj.weight"):
            weight = permute_like_llama_cpp(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = permute_like_llama_cpp(weight, config.num_key_value_heads)
        _add_tensor(writer, gguf_name(name), weight, Q.F32 if weight.ndim == 1 else qtype)
    finish(writer)


def add_sizes(writer: gguf.GGUFWriter, config: Any) -> None:
    """The hyperparameters every architecture's GGUF has, from a transformers config."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tensor(writer: gguf.GGUFWriter, name: str, weight: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, weight)
    elif qtype == Q.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)


def round_trip(weight: np.ndarray, qtype: Q) -> np.ndarray:
    """What a weight becomes after quantization (quantization blocks run along rows, so the
    q/k row permutation does not change the rounding)."""
    if weight.ndim == 1 or qtype == Q.F32:
        return weight
    return gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype).astype(np.float32)


def load_hf(directory: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


TOKEN_IDS = [1, 40, 80, 120, 200, 250, 262, 3, 17, 99, 150, 2]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_model(request: pytest.FixtureRequest) -> LlamaForCausalLM:
    return tiny_llama(tied=request.param)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_weights_are_dequantized_renamed_and_unpermuted(
    tmp_path: Path, tiny_model: LlamaForCausalLM, qtype: Q
) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, tiny_model, qtype)
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(gguf_path, out)

    converted = load_file(str(out / "model.safetensors"))
    original = hf_weights(tiny_model)
    assert set(converted) == set(original)
    for name, weight in original.items():
        assert converted[name].dtype == np.float32
        # Exactly the reference dequantization of the stored blocks, in the original order.
        np.testing.assert_array_equal(converted[name], round_trip(weight, qtype), err_msg=name)
        bound = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 4e-3, Q.Q8_0: 4e-3, Q.Q4_0: 0.1, Q.Q4_1: 0.06}
        assert np.abs(converted[name] - weight).max() <= bound[qtype] * max(1, np.abs(weight).max())


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_converted_model_logits_match_transformers(
    tmp_path: Path, tiny_model: LlamaForCausalLM, qtype: Q
) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, tiny_model, qtype)
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(gguf_path, out)
    converted = load_hf(out)

    # The reference: the original model carrying the same rounded weights.
    reference = tiny_llama(tied=tiny_model.config.tie_word_embeddings)
    rounded = {k: torch.from_numpy(round_trip(v, qtype)) for k, v in hf_weights(tiny_model).items()}
    reference.load_state_dict(rounded, strict=False)
    if reference.config.tie_word_embeddings:
        reference.tie_weights()

    got, want = logits(converted, TOKEN_IDS), logits(reference, TOKEN_IDS)
    scale = want.abs().max().item()
    print(
        f"{qtype.name}: max |logit diff| {(got - want).abs().max().item():.2e} (scale {scale:.2f})"
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * max(1.0, scale))
    if qtype == Q.F32:
        torch.testing.assert_close(got, logits(tiny_model, TOKEN_IDS), rtol=0, atol=1e-5 * scale)


def test_config_files_describe_the_model(tmp_path: Path) -> None:
    model = tiny_llama(tied=True)
    write_tiny_gguf(tmp_path / "tiny.gguf", model, Q.Q8_0)
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert config[key] == getattr(expected, key), key
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 16
    assert config["vocab_size"] == expected.vocab_size
    assert config["max_position_embeddings"] == 256
    assert config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == 1
    # <|im_end|> ends a turn in the template; <|endoftext|> is the other end-of-text token.
    assert config["eos_token_id"] == [2, 0]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["bos_token"] == "<|im_start|>"


def converted_config(tmp_path: Path, extra: Callable[[gguf.GGUFWriter], None]) -> dict:
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(tied=True), Q.F32, extra=extra)
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out)
    return json.loads((out / "config.json").read_text())


def test_linear_rope_scaling_is_carried(tmp_path: Path) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    assert converted_config(tmp_path, linear)["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 4.0,
    }


def test_llama3_rope_factors_become_llama3_rope_scaling(tmp_path: Path) -> None:
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, Llama 3.2 values.
    factor, low, high, original, head_dim = 32.0, 1.0, 4.0, 8192, 16
    freqs = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))

    def llama3(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))

    assert converted_config(tmp_path, llama3)["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def test_unknown_rope_factors_are_a_clear_error(tmp_path: Path) -> None:
    def odd(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32))

    with pytest.raises(GGUFError, match="rope_freqs"):
        converted_config(tmp_path, odd)


@pytest.mark.parametrize(
    "pre", ["smollm", "llama-bpe", "qwen2", "deepseek-r1-qwen", "tekken", "qwen35", "gpt-4o"]
)
def test_tokenizer_matches_transformers_gguf_tokenizer(tmp_path: Path, pre: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(tied=True), Q.F32, pre=pre)
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out)
    mine = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    texts = [
        "the world is in order",
        " the  theory  of   everything\n\n\tend ",
        "<|im_start|>user\nhello<|im_end|>\n<think>hm</think>",
        "naïve café — 日本語 🤖 x²",
        "in 9: 7 + 5 = 3",
        "It's THE World's order, isn't it?\r\n  A/B",
    ]
    if pre != "smollm":  # its digit split, which transformers skips: the next test
        texts.append("cafe\u0301 nai\u0308ve I'VE 1234567 x\u0301/\n")  # marks, long numbers
    for text in texts:
        # the split itself, which the tiny vocabulary's few merges would hide
        pieces = mine.pre_tokenizer.pre_tokenize_str(text)
        split = reference.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert pre == "smollm" or pieces == split, text
        ids = mine.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert mine.decode(ids, skip_special_tokens=False) == text
    assert mine.encode("<|im_end|>").ids == [2]
    assert mine.encode("<think>").ids == [len(tiny_vocab()[0]) - 1]


def test_smollm_pre_tokenizer_splits_every_digit(tmp_path: Path) -> None:
    # transformers' own GGUF tokenizer skips this step (fine for the real SmolLM2 vocabulary,
    # which has no digit merges); SmolLM's tokenizer.json and llama.cpp's "smollm" split digits.
    from tokenizers import Tokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama(tied=True), Q.F32)
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.token_to_id("20") is not None
    for text in ("2024", " 1234", "a12b20"):
        pieces = tokenizer.encode(text).tokens
        assert all(len(p) == 1 for p in pieces if p.isdigit()), (text, pieces)
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_llama_cpp_permutation_is_undone() -> None:
    weight = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 2, 3, 6):
        np.testing.assert_array_equal(
            unpermute_rope_rows(permute_like_llama_cpp(weight, heads), heads), weight
        )


@pytest.mark.parametrize(
    ("gguf_tensor", "hf_tensor"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
        ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.3.ffn_gate.weight", "model.layers.3.mlp.gate_proj.weight"),
        ("blk.3.ffn_up.weight", "model.layers.3.mlp.up_proj.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
    ],
)
def test_tensor_names_map_to_hugging_face(gguf_tensor: str, hf_tensor: str) -> None:
    assert hf_tensor_name(gguf_tensor) == hf_tensor


def test_unknown_tensor_name_is_an_error() -> None:
    with pytest.raises(GGUFError, match="ffn_gate_exps"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(path, tiny_llama(tied=True), Q.F32, arch="falcon")
    with pytest.raises(ModelFileError, match="architecture 'falcon' is not supported"):
        resolve_model(str(path), tmp_path / "cache")


def test_unsupported_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, tiny_llama(tied=True), Q.F32, tokenizer_model="bert")
    with pytest.raises(ModelFileError, match="tokenizer model 'bert' is not supported"):
        resolve_model(str(path), tmp_path / "cache")


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.97])
def test_truncated_gguf_is_a_clear_error(tmp_path: Path, keep: float) -> None:
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole, tiny_llama(tied=True), Q.Q4_1)
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError, match=r"cut\.gguf"):
        resolve_model(str(cut), tmp_path / "cache")
    assert not any((tmp_path / "cache" / "models").iterdir()), "no partial conversion is left"


def test_garbage_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        resolve_model(str(path), tmp_path / "cache")
