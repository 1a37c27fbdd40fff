"""gpt-oss's MXFP4 expert weights (gpu_worker.mxfp4): dequantized at load, bit for bit as
transformers dequantizes them, and served as the same dense checkpoint would be."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from gpu_worker import mxfp4
from gpu_worker.checkpoint import CheckpointError, load_weights
from tests.worker_fixtures import Chunk, blocks_for, make_runner, plan_for, random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROJECTIONS = ("gate_up_proj", "down_proj")


def packed(generator: torch.Generator, rows: int, cols: int, experts: int):
    """Random MXFP4 blocks [experts, rows, cols / 32, 16] and scales near 2^0."""
    groups = cols // 32
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=generator)
    scales = torch.randint(122, 130, (experts, rows, groups), generator=generator)
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
    whole 32-value groups), beside the dense checkpoint transformers would load from it."""
    source = tiny_models("gpt_oss")
    weights = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    stored, dense = dict(weights), dict(weights)
    for name in [n for n in weights if n.endswith(PROJECTIONS)]:
        experts, rows, cols = weights[name].shape  # [experts, in, out]: stored as [out, in]
        blocks, scales = packed(generator, cols, rows, experts)
        del stored[name]
        stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    models = {}
    for kind, tensors in (("mxfp4", stored), ("dense", dense)):
        models[kind] = tmp_path / kind
        shutil.copytree(source, models[kind])
        save_file(tensors, models[kind] / "model.safetensors")
    prompt = random_prompt(30, seed=2)
    logits = {}
    for kind, path in models.items():
        runner = make_runner(path)
        logits[kind] = runner.step_logits(
            plan_for(runner, [Chunk(0, prompt, 0, blocks_for(0, 30))])
        )
    assert torch.equal(logits["mxfp4"], logits["dense"])
    # a half pair is refused by name
    name = next(n for n in stored if n.endswith("_scales"))
    save_file({k: v for k, v in stored.items() if k != name}, models["mxfp4"] / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"without their pair: .*_blocks"):
        load_weights(models["mxfp4"], torch.float32)
