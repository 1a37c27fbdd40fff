"""A GGUF file's quantized weights served as they are (--quantization gguf): each block type
repacks into the worker's formats without loss (gguf.quants.dequantize is the judge), the
conversion writes them beside the float32 weights, and the worker serves them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file

from gpu_worker.checkpoint import CheckpointError, load_quantized
from gpu_worker.protocol import QUANTIZED_WEIGHTS
from gpu_worker.quant import QuantLinear
from service.model_files.gguf import convert_gguf
from service.model_files.gguf_quants import REPACKERS, repack
from tests.test_model_files_gguf import tiny_llama, write_tiny_gguf
from tests.worker_fixtures import Chunk, blocks_for, make_runner, plan_for

SHAPE = (6, 512)  # rows, K: two K-quant super-blocks per row
# gguf.quants quantizes these; the K-quants it only dequantizes
QUANTIZABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# where each K-quant block keeps its fp16 scales: (offset, count)
FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1)}


def random_blocks(kind: Q, seed: int) -> np.ndarray:
    """Random bytes, save the fp16 scales: finite, of a weight's magnitude."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (SHAPE[0] * SHAPE[1] // block, size), dtype=np.uint8)
    offset, count = FP16_FIELDS[kind]
    scales = (rng.random((blocks.shape[0], count)) * 0.01).astype(np.float16)
    blocks[:, offset : offset + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(SHAPE[0], -1)


def blocks_of(kind: Q) -> np.ndarray:
    if kind in QUANTIZABLE:
        weight = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
        return gguf.quants.quantize(weight, kind)
    return random_blocks(kind, seed=2)


def test_every_repacked_type_is_tested():
    assert set(REPACKERS) == {*QUANTIZABLE, *FP16_FIELDS}


@pytest.mark.parametrize("kind", list(REPACKERS), ids=lambda kind: kind.name)
def test_repacking_gives_the_dequantized_values_bit_for_bit(kind):
    data = blocks_of(kind)
    weight = repack(data, kind, SHAPE)
    want = gguf.quants.dequantize(data, kind).reshape(SHAPE)
    assert np.array_equal(weight.dequantize(), want)
    assert weight.values.dtype == (np.int8 if kind in (Q.Q8_0, Q.Q6_K) else np.uint8)
    assert weight.scales.shape[1] == SHAPE[1] // (16 if kind == Q.Q6_K else 32)


def test_the_worker_reads_what_the_conversion_repacked(tmp_path):
    """The file's formats (q8 groups of 16, q4 and q5 with mins) survive the trip through
    quantized.safetensors into the worker's QuantWeights, value for value."""
    tensors = {}
    for name, kind in (("a", Q.Q6_K), ("b", Q.Q4_K), ("c", Q.Q5_K)):
        weight = repack(blocks_of(kind), kind, SHAPE)
        tensors |= {f"{name}.values": weight.values, f"{name}.scales": weight.scales}
        if weight.mins is not None:
            tensors[f"{name}.mins"] = weight.mins
        tensors[f"{name}.want"] = weight.dequantize()
    save_file(
        {k: v for k, v in tensors.items() if not k.endswith("want")}, tmp_path / QUANTIZED_WEIGHTS
    )
    loaded = load_quantized(tmp_path, torch.device("cpu"))
    assert (loaded["a"].kind, loaded["a"].group, loaded["a"].mins) == ("q8", 16, None)
    assert (loaded["b"].kind, loaded["b"].group) == ("q4", 32)
    assert (loaded["c"].kind, loaded["c"].group) == ("q5", 32)
    for name in "abc":
        assert torch.equal(loaded[name].dequantize(), torch.from_numpy(tensors[f"{name}.want"]))


def test_gguf_needs_a_gguf_conversion(tiny_llama_dir):
    with pytest.raises(CheckpointError, match="converted from a GGUF file"):
        make_runner(tiny_llama_dir, quantization="gguf")


def test_a_type_without_a_kernel_is_refused(tmp_path):
    values = np.zeros((16, 32), dtype=np.int8)
    scales = np.ones((16, 1), dtype=np.float32)
    metadata = {"format": "pt", "unserved": "lm_head.weight (Q3_K)"}
    tensors = {"x.values": values, "x.scales": scales}
    save_file(tensors, tmp_path / QUANTIZED_WEIGHTS, metadata=metadata)
    with pytest.raises(CheckpointError, match=r"lm_head.weight \(Q3_K\)"):
        load_quantized(tmp_path, torch.device("cpu"))


@pytest.fixture(scope="module", params=[Q.Q4_1, Q.Q8_0], ids=lambda kind: kind.name)
def converted(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(f"gguf_{request.param.name}")
    write_tiny_gguf(directory / "tiny.gguf", tiny_llama(tied=True), request.param)
    out = directory / "converted"
    out.mkdir()
    convert_gguf(directory / "tiny.gguf", out)
    return out


def last_logits(runner, tokens: list[int]) -> torch.Tensor:
    plan = plan_for(runner, [Chunk(0, tokens, 0, blocks_for(0, len(tokens)))])
    return runner.step_logits(plan)[0]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_converted_gguf_serves_its_own_quantized_weights(converted):
    dense, served = make_runner(converted), make_runner(converted, quantization="gguf")
    model = served.model
    assert isinstance(model.layers[0].qkv, QuantLinear)
    assert isinstance(model.lm_head, QuantLinear)
    # Lossless: the served weights are the float32 conversion's, value for value (the q/k
    # rows unpermuted as there), and the tied head's rows are the embedding's.
    qkv = model.layers[0].qkv.packed[0].unpack().dequantize()
    assert torch.equal(qkv[:64], dense_weight(converted, "model.layers.0.self_attn.q_proj.weight"))
    ids = torch.arange(model.config.vocab_size)
    assert torch.equal(model.lm_head.dequantized_rows(ids), dense.model.embed)
    tokens = [5, 9, 40, 41, 7, 100, 3]
    want, got = last_logits(dense, tokens), last_logits(served, tokens)
    assert 0 < (got - want).abs().max() < 0.05 * want.abs().max()


def dense_weight(directory: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")[name]
