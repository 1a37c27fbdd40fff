"""gpt-oss's MXFP4 expert weights (gpu_worker.mxfp4): dequantized bit for bit as transformers
dequantizes them, and on the CPU kept quantized: the same weights, fewer bytes, the dense
checkpoint's logits up to the activations' quantization."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from gpu_worker import mxfp4
from gpu_worker.checkpoint import CheckpointError, load_weights
from gpu_worker.model import Model
from gpu_worker.quant import QuantLinear
from gpu_worker.runner import ModelRunner
from tests.worker_fixtures import Chunk, blocks_for, make_runner, plan_for, random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROJECTIONS = ("gate_up_proj", "down_proj")


def packed(generator: torch.Generator, rows: int, cols: int, experts: int, exponents=(122, 130)):
    """Random MXFP4 blocks [experts, rows, cols / 32, 16] and scales 2^(e - 127) for E8M0
    bytes e in `exponents` (by default near 2^0)."""
    groups = cols // 32
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=generator)
    scales = torch.randint(*exponents, (experts, rows, groups), generator=generator)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_gives_transformers_weights_bit_for_bit(dtype):
    blocks, scales = packed(torch.Generator().manual_seed(0), 48, 96, 3)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == (3, 96, 48) and ours.dtype == dtype
    assert torch.equal(ours, theirs)


def test_a_checkpoint_with_mxfp4_experts_serves_as_its_dequantized_twin(tiny_models, tmp_path):
    """The tiny gpt-oss with its experts replaced by MXFP4 ones (hidden 64, intermediate 32:
    whole 32-value groups), beside the dense checkpoint transformers would load from it. On
    the CPU the experts stay quantized: the weights they stand for are the twin's bit for
    bit, the model holds fewer bytes, and its logits differ from the twin's only by the
    activations' int8 quantization (gpu_worker.quant)."""
    source = tiny_models("gpt_oss")
    weights = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    stored, dense = dict(weights), dict(weights)
    for name in [n for n in weights if n.endswith(PROJECTIONS)]:
        experts, rows, cols = weights[name].shape  # [experts, in, out]: stored as [out, in]
        # weights of at most 6 x 2^-5, as a trained model's (near 2^0 they would swamp
        # the tiny model's other weights, and their products its logits)
        blocks, scales = packed(generator, cols, rows, experts, exponents=(118, 123))
        del stored[name]
        stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    models = {}
    for kind, tensors in (("mxfp4", stored), ("dense", dense)):
        models[kind] = tmp_path / kind
        shutil.copytree(source, models[kind])
        save_file(tensors, models[kind] / "model.safetensors")
    prompt = random_prompt(30, seed=2)
    runners = {kind: make_runner(path) for kind, path in models.items()}
    logits = {
        kind: every_rows_logits(runner, [Chunk(0, prompt, 0, blocks_for(0, 30))])
        for kind, runner in runners.items()
    }
    # each expert's matmuls: the twin's weights (gate_up's interleaved gate and up rows as
    # [gate | up]) bit for bit
    inter = runners["dense"].model.config.moe.intermediate_size
    gate_first = torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)])
    for i, layer in enumerate(runners["mxfp4"].model.layers):
        for e, pair in enumerate(layer.moe.experts):
            for matmul, projection in zip(pair, PROJECTIONS, strict=True):
                want = dense[f"model.layers.{i}.mlp.experts.{projection}"][e].T
                want = want[gate_first] if projection == "gate_up_proj" else want
                assert isinstance(matmul, QuantLinear) and matmul.packed[0].kind == "mxfp4"
                assert torch.equal(matmul.packed[0].unpack().dequantize(), want)
    assert resident_bytes(runners["mxfp4"].model) < resident_bytes(runners["dense"].model)
    want, got = logits["dense"], logits["mxfp4"]
    error = ((got - want).abs() / want.abs().amax(-1, keepdim=True)).max().item()
    # quantized (0.12% of the row's largest logit when written), not by more than that
    assert 0 < error < 0.01
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    # a half pair is refused by name
    name = next(n for n in stored if n.endswith("_scales"))
    save_file({k: v for k, v in stored.items() if k != name}, models["mxfp4"] / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"without their pair: .*_blocks"):
        load_weights(models["mxfp4"], torch.float32)


def every_rows_logits(runner: ModelRunner, seqs: list[Chunk]) -> torch.Tensor:
    return runner.model.logits(runner.forward(runner.inputs(plan_for(runner, seqs)))).dense()


def resident_bytes(model: Model) -> int:
    """The bytes of every tensor the model holds (each storage once)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    pending: list[object] = [model]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor) and item.is_mkldnn:  # oneDNN's: no storage to see
            storages[id(item)] = item.numel() * item.element_size()
        elif isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif hasattr(item, "__dict__") or hasattr(item, "__slots__"):
            pending.extend(vars(item).values() if hasattr(item, "__dict__") else [])
            for cls in type(item).__mro__:
                pending.extend(getattr(item, slot, None) for slot in getattr(cls, "__slots__", ()))
    return sum(storages.values())
