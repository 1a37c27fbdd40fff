"""The KV cache's groups of layers (gpu_worker.kv_groups), from the configs transformers
writes, and what the worker does with them: slots shared by the groups' layers, a block's
bytes, and plans that must name every group's table."""

from __future__ import annotations

import pytest
import torch
import transformers

from gpu_worker import kv_cache
from gpu_worker.kv_groups import KVGroups
from gpu_worker.model_config import ModelConfig
from tests.worker_fixtures import Chunk, blocks_for, make_plan, make_runner, plan_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config_of(config_class: str, architecture: str, **settings) -> ModelConfig:
    raw = getattr(transformers, config_class)(**settings).to_dict()
    return ModelConfig.from_dict({**raw, "architectures": [architecture]})


def gemma3(layers: int) -> ModelConfig:
    return config_of(
        "Gemma3TextConfig", "Gemma3ForCausalLM", num_hidden_layers=layers, sliding_window=512
    )


def test_layers_that_attend_alike_are_one_group_each_in_its_own_slot():
    for config in (
        config_of("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=3),
        config_of("MistralConfig", "MistralForCausalLM", num_hidden_layers=3, sliding_window=64),
    ):
        groups = KVGroups.of(config)
        assert groups.layers == ((0, 1, 2),) and groups.num_slots == 3
        assert groups.windows == (config.window_of(0),)


def test_gemma3_270m_has_a_full_group_and_five_windowed_ones_of_three_layers():
    groups = KVGroups.of(gemma3(18))  # every 6th layer is global
    assert groups.windows == (None,) + (512,) * 5
    assert groups.layers[0] == (5, 11, 17)
    assert sorted(i for layers in groups.layers[1:] for i in layers) == [
        i for i in range(18) if i % 6 != 5
    ]
    assert groups.num_slots == 3 and {len(layers) for layers in groups.layers} == {3}
    assert [groups.slot_of(i) for i in (5, 11, 17)] == [0, 1, 2]


def test_uneven_kinds_leave_the_last_group_short_and_close_counts_share_one_size():
    """Gemma 3 1B: 4 full layers, 22 windowed in groups of 4 (the last of 2); Gemma 2
    alternates: equal counts, one group of each kind."""
    groups = KVGroups.of(gemma3(26))
    assert [len(layers) for layers in groups.layers] == [4, 4, 4, 4, 4, 4, 2]
    gemma2 = KVGroups.of(config_of("Gemma2Config", "Gemma2ForCausalLM", num_hidden_layers=4))
    assert gemma2.windows == (None, 4096) and gemma2.layers == ((1, 3), (0, 2))


def test_a_block_holds_the_slots_not_every_layer():
    """A block of Gemma 3 270M names 16 positions of one group's 3 layers: a sixth of what
    a block of all 18 layers takes, and the cache's tensors are its 3 slots'."""
    config = gemma3(18)
    one_row = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bfloat16
    assert kv_cache.block_bytes(config, 16, torch.bfloat16) == 3 * 16 * one_row
    cache = kv_cache.allocate(config, 4, 16, torch.bfloat16, torch.device("cpu"))
    assert len(cache.slots) == 3 and len(cache.layers) == 18
    assert cache.layers[5] is cache.slots[0] and cache.layers[0] is cache.slots[0]
    assert cache.bytes == 5 * kv_cache.block_bytes(config, 16, torch.bfloat16)  # + scratch


def test_gemma4_layers_that_read_another_layers_kv_allocate_none():
    """A Gemma 4 of 35 layers, every 5th global, the last 20 reading the K/V of
    the last earlier layer of their kind: 15 layers hold K/V, in 3 slots, and the other 20
    attend in their sources' groups over their sources' slots. The slots are as wide as
    the global layers' heads (512), the sliding layers' (256) padded to them."""
    config = config_of(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        num_hidden_layers=35,
        head_dim=256,
        global_head_dim=512,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
        num_kv_shared_layers=20,
    )
    assert [config.kv_source(i) for i in (13, 14, 15, 19, 34)] == [13, 14, 13, 14, 14]
    groups = KVGroups.of(config)
    assert groups.layers == ((4, 9, 14), (0, 1, 2), (3, 5, 6), (7, 8, 10), (11, 12, 13))
    assert groups.num_slots == 3
    assert groups.group_of(34) == 0 and groups.slot_of(34) == groups.slot_of(14) == 2
    assert groups.group_of(33) == groups.group_of(13) == 4
    assert (config.head_dim, config.head_dim_of(4), config.head_dim_of(33)) == (512, 512, 256)
    one_row = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bfloat16
    assert kv_cache.block_bytes(config, 16, torch.bfloat16) == 3 * 16 * one_row
    cache = kv_cache.allocate(config, 4, 16, torch.bfloat16, torch.device("cpu"))
    assert cache.layers[34] is cache.layers[14] and len(cache.slots) == 3


def test_a_hybrid_models_plan_must_name_a_table_for_every_group(tiny_models):
    runner = make_runner(tiny_models("gemma3"))  # a full group and two windowed ones
    assert runner.limits.num_groups == 3
    chunk = Chunk(0, [5, 6, 7, 8, 9], 0, blocks_for(0, 5))
    missing = runner.execute(make_plan([chunk]))
    assert "3 KV groups" in (missing.error or "")
    short = plan_for(runner, [chunk])
    short.rows[0].blocks[2] = short.rows[0].blocks[2][:1]
    assert "tables grow together" in (runner.execute(short).error or "")
    assert runner.execute(plan_for(runner, [chunk])).error is None
