"""LoRA adapters in the worker (gpu_worker.lora, lora_files, triton_lora) against PEFT.

Adapters are made here with peft on the tiny random Llama and on the default model
(random non-zero A and B, ranks 8, 16 and 64, one with rsLoRA, one targeting three of the
seven modules), saved, and loaded by the worker into its slots: prefill logits and greedy
continuations equal PEFT's in float32, for each adapter alone and for rows of three
adapters and the base in one step; in bfloat16 a row's bits are the same beside other
adapters' rows; loading another adapter into a slot replaces it exactly; malformed
adapters are refused naming the field. The Triton kernels run under Triton's interpreter
against the float64 reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gpu_worker import lora
from gpu_worker.lora_files import TARGET_MODULES, read_adapter, tensor_name
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import AdapterLoad, StepPlan
from gpu_worker.runner import ModelRunner
from gpu_worker.tensor_parallel import Shard
from ops.worker_steps import Blocks
from tests.tensor_parallel_helpers import build_runner, run_ranks
from tests.triton_interpreter import run_interpreted
from tests.worker_fixtures import (
    BLOCK_SIZE,
    Chunk,
    hf_model,
    make_runner,
    max_diff,
    plan_for,
    random_prompt,
    sampled,
)

# name -> (rank, alpha, rsLoRA, target modules, seed)
ADAPTERS = {
    "r8": (8, 16, False, TARGET_MODULES, 1),
    "r64-rs": (64, 32, True, TARGET_MODULES, 2),
    "r16-qv-down": (16, 8, False, ("q_proj", "v_proj", "down_proj"), 3),
}
DECODED = 5  # greedy tokens after each prompt


def tolerance(reference: torch.Tensor) -> float:
    return 1e-4 * max(1.0, reference.abs().max().item())  # as tests/test_worker_model.py


def make_adapter(base_dir: Path, out: Path, spec: tuple) -> torch.nn.Module:
    """A PEFT model of `base_dir` with random non-zero A and B, its adapter saved to `out`."""
    from peft import LoraConfig, get_peft_model

    rank, alpha, rslora, targets, seed = spec
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora)
    model = get_peft_model(hf_model(base_dir), config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # A's rows and B's columns about unit-norm products
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return model


def reference_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]


def reference_greedy(model: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def load_plan(loads: list[AdapterLoad], step_id: int = 0) -> StepPlan:
    return StepPlan(step_id, [], [], adapters=loads)


def run_greedy(
    runner: ModelRunner, prompts: dict[int, tuple[list[int], str | None]], count: int
) -> dict[int, list[int]]:
    """Every (prompt, adapter) of `prompts` in one step per token: the prompts' prefill
    together, then `count - 1` decode steps of all of them."""
    blocks = Blocks(BLOCK_SIZE)
    tables = {seq_id: blocks.take(len(p) + count) for seq_id, (p, _) in prompts.items()}
    chunks = [Chunk(i, p, 0, tables[i], adapter=a) for i, (p, a) in prompts.items()]
    found = dict(
        zip(prompts, ([t] for t in sampled(runner.execute(plan_for(runner, chunks)))), strict=True)
    )
    for _ in range(count - 1):
        chunks = [
            Chunk(i, found[i][-1:], len(p) + len(found[i]) - 1, tables[i], adapter=a)
            for i, (p, a) in prompts.items()
        ]
        for seq_id, token in zip(
            prompts, sampled(runner.execute(plan_for(runner, chunks))), strict=True
        ):
            found[seq_id].append(token)
    return found


def step_logits(
    runner: ModelRunner, prompts: dict[int, tuple[list[int], str | None]]
) -> torch.Tensor:
    """The prompts' prefill in one step: each one's last logits [S, vocab]."""
    blocks = Blocks(BLOCK_SIZE)
    chunks = [Chunk(i, p, 0, blocks.take(len(p)), adapter=a) for i, (p, a) in prompts.items()]
    return runner.step_logits(plan_for(runner, chunks))


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: (root / name, make_adapter(tiny_llama_dir, root / name, spec))
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir, adapters) -> ModelRunner:
    """A float32 runner with the three adapters in slots 0..2."""
    runner = make_runner(tiny_llama_dir, max_loras=3, max_lora_rank=64)
    loads = [
        AdapterLoad(slot, name, str(path))
        for slot, (name, (path, _)) in enumerate(adapters.items())
    ]
    assert runner.execute(load_plan(loads)).error is None
    return runner


PROMPTS = {name: random_prompt(5 + i, 10 + i) for i, name in enumerate([*ADAPTERS, None])}


def test_each_adapter_alone_matches_peft(loaded, adapters, tiny_llama_dir, one_torch_thread):
    base = hf_model(tiny_llama_dir)
    for name, (_, model) in adapters.items():
        prompt = PROMPTS[name]
        reference = reference_logits(model, prompt)
        assert max_diff(reference, reference_logits(base, prompt)) > 0.1, "the adapter is a no-op"
        logits = step_logits(loaded, {0: (prompt, name)})[0]
        assert max_diff(logits, reference) < tolerance(reference), name
        tokens = run_greedy(loaded, {0: (prompt, name)}, DECODED)[0]
        assert tokens == reference_greedy(model, prompt, DECODED), name


def test_three_adapters_and_the_base_in_one_step_match_peft(
    loaded, adapters, tiny_llama_dir, one_torch_thread
):
    models = {name: model for name, (_, model) in adapters.items()} | {
        None: hf_model(tiny_llama_dir)
    }
    prompts = {i: (PROMPTS[name], name) for i, name in enumerate(models)}
    logits = step_logits(loaded, prompts)
    for i, name in enumerate(models):
        reference = reference_logits(models[name], PROMPTS[name])
        assert max_diff(logits[i], reference) < tolerance(reference), name
    found = run_greedy(loaded, prompts, DECODED)
    for i, name in enumerate(models):
        assert found[i] == reference_greedy(models[name], PROMPTS[name], DECODED), name


def test_loading_into_a_held_slot_replaces_it_exactly(loaded, adapters, one_torch_thread):
    prompt = PROMPTS["r16-qv-down"]
    before = step_logits(loaded, {0: (prompt, "r16-qv-down")})[0]
    path_r8, path_qv = adapters["r8"][0], adapters["r16-qv-down"][0]
    running = step_logits(loaded, {1: (PROMPTS["r8"], "r8")})  # seq 1 runs on slot 0
    busy = loaded.execute(load_plan([AdapterLoad(0, "again", str(path_qv))]))
    assert busy.error is not None and "slot 0 holds 'r8'" in busy.error
    assert torch.equal(step_logits(loaded, {2: (PROMPTS["r8"], "r8")})[0], running[0])
    assert loaded.execute(StepPlan(1, [], [], finished=[1, 2])).error is None
    assert loaded.execute(load_plan([AdapterLoad(0, "again", str(path_qv))])).error is None
    assert torch.equal(step_logits(loaded, {0: (prompt, "again")})[0], before)
    gone = loaded.execute(plan_for(loaded, [Chunk(0, prompt, 0, [0, 1], adapter="r8")]))
    assert gone.error is not None and "'r8'" in gone.error  # a plan error: the worker serves on
    assert loaded.execute(StepPlan(2, [], [], finished=[0])).error is None
    assert loaded.execute(load_plan([AdapterLoad(0, "r8", str(path_r8))])).error is None
    reference = reference_logits(adapters["r8"][1], PROMPTS["r8"])
    logits = step_logits(loaded, {0: (PROMPTS["r8"], "r8")})[0]
    assert max_diff(logits, reference) < tolerance(reference)


def test_bfloat16_rows_keep_their_bits_beside_other_adapters(
    tiny_llama_dir, adapters, one_torch_thread
):
    runner = make_runner(tiny_llama_dir, dtype="bfloat16", max_loras=3, max_lora_rank=64)
    loads = [
        AdapterLoad(slot, name, str(path))
        for slot, (name, (path, _)) in enumerate(adapters.items())
    ]
    assert runner.execute(load_plan(loads)).error is None
    prompt = PROMPTS["r64-rs"]
    alone = step_logits(runner, {0: (prompt, "r64-rs")})[0]
    crowd = {i: (PROMPTS[name], name) for i, name in enumerate([*ADAPTERS, None])}
    crowd[4] = (random_prompt(9, 20), "r64-rs")  # its segment of the delta grows too
    beside = step_logits(runner, crowd)[1]  # seq 1: r64-rs among r8, r16-qv-down and the base
    assert torch.equal(alone, beside)
    decoded_alone = run_greedy(runner, {1: (prompt, "r64-rs")}, 3)[1]
    assert run_greedy(runner, crowd, 3)[1] == decoded_alone


def test_malformed_adapters_are_refused_naming_the_field(
    adapters, tiny_llama_dir, tmp_path, loaded
):
    good = adapters["r8"][0]
    config = ModelConfig.from_dir(tiny_llama_dir)
    cases = {
        "r is 8, above": ({}, 4),
        "target_modules ['lm_head']": ({"target_modules": ["q_proj", "lm_head"]}, 64),
        "use_dora": ({"use_dora": True}, 64),
        "bias": ({"bias": "lora_only"}, 64),
        "modules_to_save": ({"modules_to_save": ["lm_head"]}, 64),
        "lora_alpha": ({"lora_alpha": "big"}, 64),
    }
    for expected, (changes, max_rank) in cases.items():
        bad = tmp_path / expected.split()[0]
        shutil.copytree(good, bad)
        settings = json.loads((bad / "adapter_config.json").read_text()) | changes
        (bad / "adapter_config.json").write_text(json.dumps(settings))
        with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            read_adapter(bad, config, max_rank)
    from safetensors.torch import load_file, save_file

    tensors = load_file(good / "adapter_model.safetensors")
    name = tensor_name(1, "up_proj", "B")
    for index, (expected, changed) in enumerate(
        {
            f"{name} has shape \\[128, 4\\]": tensors | {name: torch.zeros(128, 4)},
            f"{name} missing": {k: v for k, v in tensors.items() if k != name},
            "cannot apply": tensors | {"base_model.model.lm_head.weight": torch.zeros(1)},
        }.items()
    ):
        bad = tmp_path / f"tensors{index}"
        shutil.copytree(good, bad)
        save_file(changed, bad / "adapter_model.safetensors")
        with pytest.raises(ValueError, match=expected):
            read_adapter(bad, config, 64)
    with pytest.raises(ValueError, match=r"adapter_config\.json not found"):
        read_adapter(tmp_path, config, 64)
    # through a plan: the step fails naming the field, the slot keeps its adapter
    assert loaded.execute(StepPlan(3, [], [], finished=list(range(4)))).error is None
    refused = loaded.execute(load_plan([AdapterLoad(0, "dora", str(tmp_path / "use_dora"))]))
    assert refused.error is not None and "use_dora" in refused.error
    assert loaded.model.lora is not None and loaded.model.lora.slot_of("r8") == 0


def tp_logits(shard: Shard, model_dir: str, adapter_dirs: list[str]) -> torch.Tensor:
    """On each rank (tests.tensor_parallel_helpers.run_ranks): the three adapters loaded
    into this rank's slices, and the step of their rows and the base's: its logits."""
    runner = build_runner(Path(model_dir), torch.float32, shard)
    config = ModelConfig.from_dir(model_dir)
    slots = lora.LoraSlots(config, len(adapter_dirs), 64, torch.float32, torch.device("cpu"), shard)
    runner.model.lora, runner.table.adapter_slot_of = slots, slots.slot_of
    loads = [
        AdapterLoad(slot, name, path)
        for slot, (name, path) in enumerate(zip(ADAPTERS, adapter_dirs, strict=True))
    ]
    assert runner.execute(load_plan(loads)).error is None
    return step_logits(
        runner, {i: (PROMPTS[name], name) for i, name in enumerate([*ADAPTERS, None])}
    )


def test_two_tensor_parallel_ranks_give_one_ranks_logits(
    loaded, adapters, tiny_llama_dir, tmp_path
):
    """Each rank's slices of A (o_proj, down) or B (q/k/v, gate/up) sum, through the
    all-reduces, to TP=1's deltas."""
    dirs = [str(path) for path, _ in adapters.values()]
    split = run_ranks(tp_logits, (str(tiny_llama_dir), dirs), 2, tmp_path)
    whole = step_logits(
        loaded, {i: (PROMPTS[name], name) for i, name in enumerate([*ADAPTERS, None])}
    )
    assert max_diff(split, whole) < tolerance(whole)


# the Triton kernels: (tokens, in, [out of each part], max rank, slots' ranks)
KERNEL_CASE = (11, 80, [48, 16, 16], 16, [16, 4, 8])
TOKEN_SLOTS = [2, -1, 0, 2, 1, -1, 0, 0, 2, 1, -1]


def kernel_inputs(dtype: torch.dtype) -> tuple:
    tokens, inp, outs, max_rank, ranks = KERNEL_CASE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((tokens, inp), generator=generator).to(dtype)
    a_parts, b_parts = [], []
    for out in outs:
        a = torch.randn((len(ranks), max_rank, inp), generator=generator) / inp**0.5
        b = torch.randn((len(ranks), out, max_rank), generator=generator) / max_rank**0.5
        for slot, rank in enumerate(ranks):  # zero beyond each slot's rank, as LoraSlots
            a[slot, rank:], b[slot, :, rank:] = 0, 0
        a_parts.append(a.to(dtype))
        b_parts.append(b.to(dtype))
    base = torch.randn((tokens, sum(outs)), generator=generator).to(dtype)
    scales = torch.tensor([0.5, 2.0, 1.25])
    return x, a_parts, b_parts, base, scales


def reference_output(dtype: torch.dtype) -> torch.Tensor:
    """The CPU path's rule: each adapted token's delta in float64, rounded, added."""
    x, a_parts, b_parts, base, scales = kernel_inputs(dtype)
    out = base.clone()
    for token, slot in enumerate(TOKEN_SLOTS):
        if slot < 0:
            continue
        column = 0
        for a, b in zip(a_parts, b_parts, strict=True):
            delta = (
                (x[token].double() @ a[slot].double().T) @ b[slot].double().T * float(scales[slot])
            )
            out[token, column : column + b.shape[1]] += delta.to(dtype)
            column += b.shape[1]
    return out


def interpret(path: str, model_dir: str, *adapter_dirs: str) -> None:
    """Runs in the subprocess, under TRITON_INTERPRET=1: the kernels' outputs per dtype,
    and each fused linear's output from LoraSlots' CPU path and its Triton path (slots of
    the adapters at `adapter_dirs`)."""
    from gpu_worker.triton_lora import lora_expand, lora_shrink

    step = lora.LoraStep.of(torch.tensor(TOKEN_SLOTS), torch.device("cpu"))
    assert step is not None
    outputs = slots_outputs(model_dir, adapter_dirs)
    for dtype in (torch.float32, torch.bfloat16):
        x, a_parts, b_parts, out, scales = kernel_inputs(dtype)
        column = 0
        for a, b in zip(a_parts, b_parts, strict=True):
            shrunk = lora_shrink(x, a, step.tokens, step.slots)
            lora_expand(shrunk, b, scales, step.tokens, step.slots, out, column)
            column += b.shape[1]
        outputs[str(dtype)] = out
    torch.save(outputs, path)


@pytest.fixture(scope="module")
def interpreted(tiny_llama_dir, adapters, tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("triton") / "outputs.pt"
    dirs = [str(adapter_dir) for adapter_dir, _ in adapters.values()]
    run_interpreted(__name__, str(path), str(tiny_llama_dir), *dirs)
    return torch.load(path, weights_only=False)


def slots_outputs(model_dir: str, adapter_dirs: tuple[str, ...]) -> dict:
    """{(path, linear): output} for path "cpu" and "triton", of layer 1's fused linears."""
    config = ModelConfig.from_dir(model_dir)
    slots = lora.LoraSlots(config, len(adapter_dirs), 64, torch.float32, torch.device("cpu"))
    for slot, adapter_dir in enumerate(adapter_dirs):
        slots.load(AdapterLoad(slot, f"a{slot}", adapter_dir))
    slots.begin(torch.tensor(TOKEN_SLOTS))
    generator = torch.Generator().manual_seed(0)
    widths = {"qkv": 64, "o_proj": 64, "gate_up": 64, "down": config.intermediate_size}
    outputs = {}
    for path, kernels in (("cpu", None), ("triton", lora._triton_kernels())):
        slots.kernels = kernels
        for linear, width in widths.items():
            x = torch.randn((len(TOKEN_SLOTS), width), generator=generator)
            parts = lora.FUSED_PARTS[linear]
            out_width = sum(slots.b[(1, module)].shape[1] for module in parts)
            out = torch.zeros((len(TOKEN_SLOTS), out_width))
            outputs[(path, linear)] = slots.add_(1, linear, x, out)
        generator.manual_seed(0)  # the same inputs for the other path
    return outputs


def test_triton_kernels_match_the_reference(interpreted):
    outputs = interpreted
    for dtype in (torch.float32, torch.bfloat16):
        expected = reference_output(dtype)
        found = outputs[str(dtype)]
        untouched = [t for t, slot in enumerate(TOKEN_SLOTS) if slot < 0]
        assert torch.equal(found[untouched], kernel_inputs(dtype)[3][untouched])
        # float32 sums in another order than float64's rounding; bfloat16 may round the
        # delta to the neighbouring value
        limit = 1e-5 if dtype == torch.float32 else 0.02
        assert max_diff(found, expected) < limit * expected.abs().max().item(), dtype


def test_the_slots_triton_path_matches_their_cpu_path(interpreted):
    """LoraSlots on CUDA (gpu_worker.triton_lora), interpreted: every fused linear's parts
    in their columns, each slot's rank and scale, the base's tokens untouched."""
    outputs = interpreted
    for linear in lora.FUSED_PARTS:
        expected, found = outputs[("cpu", linear)], outputs[("triton", linear)]
        assert expected.abs().max() > 0.1, linear
        assert max_diff(found, expected) < 1e-5 * expected.abs().max().item(), linear


@pytest.mark.real_model
def test_the_default_model_with_an_adapter_beside_the_base_matches_peft(
    default_model_dir, tmp_path
):
    """SmolLM2-135M-Instruct with a rank-64 rsLoRA adapter of all seven modules, its row
    beside the base's in one step: prefill logits and greedy tokens as PEFT's (kept small:
    the tiny model's tests cover the other adapters and their mixes)."""
    path = tmp_path / "r64-rs"
    models = {"r64-rs": make_adapter(default_model_dir, path, ADAPTERS["r64-rs"])}
    models[None] = hf_model(default_model_dir)
    runner = make_runner(default_model_dir, kv_memory=float(1 << 24), max_loras=1, max_lora_rank=64)
    assert runner.execute(load_plan([AdapterLoad(0, "r64-rs", str(path))])).error is None
    prompts = {i: (random_prompt(5, 30 + i), name) for i, name in enumerate(models)}
    logits = step_logits(runner, prompts)
    found = run_greedy(runner, prompts, 2)
    for i, (prompt, name) in prompts.items():
        reference = reference_logits(models[name], prompt)
        assert max_diff(logits[i], reference) < tolerance(reference), name
        assert found[i] == reference_greedy(models[name], prompt, 2), name
