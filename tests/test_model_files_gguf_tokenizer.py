"""SentencePiece GGUF tokenizers (Llama 2, Mistral v0.x, TinyLlama, Gemma, Phi-3), rebuilt by
cadence and checked against transformers' GGUF tokenizer of the same file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from service.model_files.gguf import _metadata
from service.model_files.gguf_tokenizer import build_tokenizer, tokenizer_config
from tests.test_model_files_gguf import finish

BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = [
    "▁", "t", "h", "e", "▁t", "he", "▁the", "w", "o", "r", "l", "d", "▁w", "or", "▁wor",
    "ld", "▁world", "a", "n", "i", "▁a", "in", "▁in", "é", "日", "本", "x", "y", "▁▁",
    "▁▁▁", "s", "c", "f", "▁c", "af", "▁caf", "é", "th", "▁th",
]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TEXTS = [
    "the world",
    " the  world\n\nin a",
    "   three leading, two trailing  ",
    "naïve café — 日本語 🤖 x²",
    "tab\there\r\nand\x00nul",
    "<s>the</s> literal specials <start_of_turn>user\nhi<end_of_turn>",
    "thethethe worldworld",
    "",
]


def spm_vocab(flavor: str) -> tuple[list[str], list[int], list[float]]:
    """Special tokens, byte tokens, pieces (scores falling with their index), as llama.cpp's
    _set_vocab_sentencepiece writes them; Gemma's have its turn markers and its
    user-defined runs of newlines and spaces."""
    if flavor == "gemma3":
        specials = [
            "<pad>",
            "<eos>",
            "<bos>",
            "<unk>",
            "<mask>",
            "<start_of_turn>",
            "<end_of_turn>",
        ]
        user = ["\n", "\n\n", "  "]
    else:
        specials, user = ["<unk>", "<s>", "</s>"], []
    tokens = specials + BYTES + PIECES + user
    types = [3] * len(specials) + [6] * 256 + [1] * len(PIECES) + [4] * len(user)
    if flavor != "gemma3":
        types[0] = 2  # <unk>
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(PIECES))]
    return tokens, types, scores + [-1000.0] * len(user)


def write_spm_gguf(path: Path, flavor: str, add_space_prefix: bool | None) -> None:
    arch = {"llama": "llama", "gemma3": "gemma3", "phi3": "phi3"}[flavor]
    tokens, types, scores = spm_vocab(flavor)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(tokens.index("<bos>" if flavor == "gemma3" else "<s>"))
    writer.add_eos_token_id(tokens.index("<eos>" if flavor == "gemma3" else "</s>"))
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_add_bos_token(True)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if flavor == "gemma3":
        writer.add_chat_template(TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    finish(writer)


FLAVORS = [("llama", None), ("llama", False), ("gemma3", False), ("phi3", None)]


@pytest.mark.parametrize(("flavor", "prefix"), FLAVORS, ids=[f"{f}-prefix-{p}" for f, p in FLAVORS])
def test_sentencepiece_tokenizer_matches_transformers(
    tmp_path: Path, flavor: str, prefix: bool | None
) -> None:
    path = tmp_path / "spm.gguf"
    write_spm_gguf(path, flavor, prefix)
    built, _ = build_tokenizer(_metadata(gguf.GGUFReader(path)))
    built.save(str(tmp_path / "tokenizer.json"))
    mine = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = mine.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert mine.encode(text).ids == reference.encode(text), text  # with BOS
        assert mine.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    byte_fallback = mine.encode("🤖", add_special_tokens=False).tokens
    assert byte_fallback[-4:] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]


def test_gemma_end_of_turn_ends_generation(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    write_spm_gguf(path, "gemma3", False)
    meta = _metadata(gguf.GGUFReader(path))
    tokenizer, special = build_tokenizer(meta)
    tokens = spm_vocab("gemma3")[0]
    # The template's end of turn first (what an instruct model emits), then <eos>.
    assert special.eos_ids == [tokens.index("<end_of_turn>"), tokens.index("<eos>")]
    config = tokenizer_config(meta, special, 512)
    assert config["eos_token"] == "<end_of_turn>"
    assert config["chat_template"] == TEMPLATE
    # The template writes {{ bos_token }}: a chat is encoded without adding another.
    assert config["bos_token"] == "<bos>"
    bos, start = tokens.index("<bos>"), tokens.index("<start_of_turn>")
    assert tokenizer.encode("<start_of_turn>").ids == [bos, start]
