"""LoRA adapters on the service's side (service.engine.adapters): PEFT adapters made by peft
validated against the base model's shapes, with a 400's field named for each fault; the
worker's slots filled at admission, more adapters than slots served in turn; the prefix
cache's block hashes salted by the adapter; a policy's bound on a step's adapters."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import peft
import pytest
import transformers

from policies.base import Decision
from policies.registry import make_policy
from service.engine.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    AdapterRegistry,
    AdapterSlots,
    BaseShapes,
)
from service.engine.block_manager import chain_hashes
from service.engine.prefix_cache import prefix_hit, salt_of
from service.engine.request import Request
from service.engine.scheduler import Scheduler
from tests.policy_views import seq, view
from tests.scheduler_helpers import make_request, make_scheduler, sampled_result

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama(hidden: int = 32) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return transformers.LlamaForCausalLM(config)


def save_adapter(model: transformers.PreTrainedModel, path: Path, rank: int) -> Path:
    config = peft.LoraConfig(r=rank, target_modules=TARGETS, init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama's config.json, adapters of it (ranks 8 and 32) and one of a wider model."""
    root = tmp_path_factory.mktemp("adapters")
    tiny_llama().config.save_pretrained(root / "base")
    return {
        "base": root / "base",
        "r8": save_adapter(tiny_llama(), root / "r8", 8),
        "r32": save_adapter(tiny_llama(), root / "r32", 32),
        "wider": save_adapter(tiny_llama(hidden=48), root / "wider", 8),
    }


def registry(made: dict[str, Path]) -> AdapterRegistry:
    return AdapterRegistry(BaseShapes.of_model(made["base"]), max_rank=16)


def test_a_peft_adapter_of_the_base_model_registers_with_its_rank(made):
    adapter = registry(made).register("support", str(made["r8"]))
    assert (adapter.name, adapter.rank) == ("support", 8)


def copy_with(made: dict[str, Path], tmp_path: Path, **config_changes: object) -> Path:
    """The rank-8 adapter with its adapter_config.json changed."""
    path = tmp_path / "changed"
    shutil.copytree(made["r8"], path)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    (path / ADAPTER_CONFIG).write_text(json.dumps({**config, **config_changes}))
    return path


def test_adapters_that_do_not_fit_are_refused_naming_the_field(made, tmp_path):
    def field_of(path: Path) -> str:
        with pytest.raises(AdapterError) as refused:
            registry(made).register("x", str(path))
        return refused.value.field

    assert field_of(made["r32"]) == "r"  # above --max-lora-rank 16
    assert field_of(copy_with(made, tmp_path / "a", target_modules=["lm_head"])) == (
        "target_modules"
    )
    assert field_of(copy_with(made, tmp_path / "b", r=4)) == (
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"  # [8, 64], r=4 wants [4, 64]
    )
    wider = field_of(made["wider"])
    assert wider.startswith("base_model.model.model.layers.0.") and wider.endswith(".weight")
    broken = copy_with(made, tmp_path / "c")
    (broken / ADAPTER_WEIGHTS).write_bytes(b"\xff" * 64)
    assert field_of(broken) == ADAPTER_WEIGHTS
    (broken / ADAPTER_CONFIG).write_text("{not json")
    assert field_of(broken) == ADAPTER_CONFIG
    assert field_of(tmp_path / "nowhere") == "lora_path"


def with_adapter(request: Request, name: str) -> Request:
    request.params = dataclasses.replace(request.params, adapter=name, adapter_path=f"/{name}")
    return request


def lora_scheduler(slots: int) -> Scheduler:
    sched, _ = make_scheduler(num_blocks=64, block_size=4, max_tokens=64, max_seqs=4)
    sched.adapter_slots = AdapterSlots(slots)
    return sched


def step(sched: Scheduler, schedule: list[tuple[int, int]]):
    sched.policy.next = Decision(schedule=schedule)  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    sched.update(out, sampled_result(out))
    return out


def test_three_adapters_over_two_slots_are_served_in_turn():
    sched = lora_scheduler(slots=2)
    for seq_id, name in enumerate(["a", "b", "c"]):
        sched.add(with_adapter(make_request(seq_id, 4, max_tokens=2), name))
    first = step(sched, [(0, 4), (1, 4), (2, 4)])
    assert [item.request.seq_id for item in first.scheduled] == [0, 1]  # c waits for a slot
    assert [(load.slot, load.name, load.path) for load in first.plan.adapters] == [
        (0, "a", "/a"),
        (1, "b", "/b"),
    ]
    assert [new.adapter for new in first.plan.new] == ["a", "b"]
    assert sched.corrections["adapter_slots_busy"] == 1
    assert [r.seq_id for r in sched.waiting] == [2]
    step(sched, [(0, 1), (1, 1), (2, 4)])  # a and b end (max_tokens 2); c still waits
    third = step(sched, [(2, 4)])
    assert [(load.slot, load.name) for load in third.plan.adapters] == [(0, "c")]  # a's LRU slot
    assert [new.adapter for new in third.plan.new] == ["c"]


def test_a_held_adapter_loads_once_and_a_new_worker_loads_it_again():
    sched = lora_scheduler(slots=2)
    sched.add(with_adapter(make_request(0, 4, max_tokens=1), "a"))
    assert [load.name for load in step(sched, [(0, 4)]).plan.adapters] == ["a"]
    sched.add(with_adapter(make_request(1, 4, max_tokens=1), "a"))
    assert step(sched, [(1, 4)]).plan.adapters == []  # slot 0 holds it still
    sched.replace_blocks(sched.blocks)  # what a worker restart does
    sched.add(with_adapter(make_request(2, 4, max_tokens=1), "a"))
    assert [load.name for load in step(sched, [(2, 4)]).plan.adapters] == ["a"]


def test_block_hashes_differ_per_adapter_and_no_prefix_is_shared_across_them():
    tokens = list(range(16))
    requests = [make_request(i, 16, family=0) for i in range(3)]
    with_adapter(requests[1], "a")
    with_adapter(requests[2], "b")
    hashes = [chain_hashes(tokens, 4, [], salt_of(r)) for r in requests]
    assert len({h[0] for h in hashes}) == 3  # the base, a and b: three first blocks
    sched, _ = make_scheduler(num_blocks=64, block_size=4, max_tokens=64, prefix_caching=True)
    sched.add(requests[1])
    step(sched, [(1, 16)])
    same_adapter = with_adapter(make_request(5, 16, family=0), "a")
    assert prefix_hit(sched.blocks, same_adapter).num_blocks == 3  # 12 of its 16 tokens
    assert prefix_hit(sched.blocks, requests[2]).num_blocks == 0  # b under a's prompt
    assert prefix_hit(sched.blocks, requests[0]).num_blocks == 0  # the base


@pytest.mark.parametrize("policy", ["stall_free", "fcfs"])
def test_a_policy_bounds_the_adapters_of_a_step(policy):
    """max_adapters_per_step=1: the base and one adapter's rows run, another adapter's wait."""
    decoding = [
        dataclasses.replace(seq(i, 8, generated=1), adapter=name)
        for i, name in enumerate(["a", "b", None, "a"])
    ]
    waiting = [dataclasses.replace(seq(i, 8), adapter=name) for i, name in [(4, "b"), (5, "a")]]
    bounded = make_policy(policy, {"max_adapters_per_step": 1})
    decision = bounded.decide(view(running=decoding))
    assert [seq_id for seq_id, _ in decision.schedule] == [0, 2, 3]
    decision = bounded.decide(view(waiting=waiting))
    assert [seq_id for seq_id, _ in decision.schedule] == [4]
    unbounded = make_policy(policy, {}).decide(view(running=decoding))
    assert len(unbounded.schedule) == 4
