"""The linear-attention layers' state cache (gpu_worker.recurrent_state): a row per slot of
the worker's SeqTable, zeroed when a slot is given, each row checked to continue its state;
and what a model with such layers refuses at start."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker import runtime
from gpu_worker.kv_groups import KVGroups
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import NewSeq, SamplingSpec, StepPlan, WorkerConfig
from gpu_worker.recurrent_state import MIN_SLOTS, RecurrentState, StateStep
from gpu_worker.seq_table import PlanLimits, SeqTable

QWEN3_5 = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
}


def introduce(table: SeqTable, *seq_ids: int, finished: tuple[int, ...] = ()) -> None:
    new = [NewSeq(seq_id, SamplingSpec(), 4) for seq_id in seq_ids]
    table.apply(StepPlan(0, [], [], new=new, finished=list(finished)))


def test_the_state_grows_with_the_table_and_a_given_slot_starts_at_zero():
    config = ModelConfig.from_dict(QWEN3_5)
    assert KVGroups.of(config).layers == ((3,),)  # the linear layers hold no KV blocks
    assert config.rotary_dim == 4
    state = RecurrentState(config, torch.float32, torch.device("cpu"))
    table = SeqTable(PlanLimits(4, 64, 256, 64), torch.device("cpu"))
    table.slot_given = state.give
    introduce(table, 0)
    kept = state.recurrent[state.layers[1]][table.seq(0).slot].fill_(4.0)
    introduce(table, *range(1, MIN_SLOTS + 3))  # past the first rows: both grow
    assert torch.equal(state.recurrent[state.layers[1]][table.seq(0).slot], kept)
    slots = [table.seq(seq_id).slot for seq_id in range(MIN_SLOTS + 3)]
    assert table.tables.shape[1] > MIN_SLOTS + 3 and max(slots) < state.num_slots
    slot = table.seq(5).slot
    # conv [conv_dim, kernel - 1] in the model's dtype, recurrent float32 [4, 16, 8]: 3 layers
    assert state.bytes_per_slot == 3 * ((2 * 2 * 16 + 4 * 8) * 3 * 4 + 4 * 16 * 8 * 4)
    for layer in state.layers:
        state.conv[layer][slot].fill_(1.0)
        state.recurrent[layer][slot].fill_(2.0)
    StateStep.of(state, [slot], [0], [7], [False])
    assert state.positions[slot] == 7
    introduce(table, 5, finished=(5,))  # preempted and introduced again: recomputed from 0
    assert table.seq(5).slot == slot and state.positions[slot] == 0
    for layer in state.layers:
        assert not state.conv[layer][slot].any() and not state.recurrent[layer][slot].any()
    state.recurrent[state.layers[0]][slot].fill_(3.0)
    introduce(table, 99, finished=(5,))  # a finished sequence's slot is the next one given
    assert table.seq(99).slot == slot and not state.recurrent[state.layers[0]][slot].any()


def test_a_row_must_continue_its_sequences_state():
    state = RecurrentState(ModelConfig.from_dict(QWEN3_5), torch.float32, torch.device("cpu"))
    state.give(0)
    with pytest.raises(ValueError, match="recurrent state stands at 0"):
        StateStep.of(state, [0], [16], [3], [False])  # a prefix-cache hit
    with pytest.raises(ValueError, match="rejected draft cannot be taken back"):
        StateStep.of(state, [0], [0], [3], [True])
    with state.trials():  # the start-up's trial steps start anywhere
        StateStep.of(state, [0], [16], [3], [False])
    state.give(0)
    step = StateStep.of(state, [0], [0], [1], [False])  # a decode row
    assert step.chunks == [] and step.decode_slots.tolist() == [0]


@pytest.mark.parametrize(
    ("setting", "feature"),
    [
        ({"draft_model_dir": "/nonexistent"}, "a draft model"),
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
        ({"kv_transfer_engine": "local"}, "a KV transfer engine"),
    ],
)
def test_a_linear_attention_model_refuses_what_a_recurrent_state_cannot_serve(
    setting, feature, tmp_path
):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5))
    with pytest.raises(ValueError, match=f"linear-attention layers, .* served with {feature}"):
        runtime.check(WorkerConfig(model_dir=str(tmp_path), **setting))


def test_a_config_without_layer_types_has_every_fourth_layer_full():
    """Qwen3-Next's first configs: full_attention_interval instead of layer_types, and
    partial_rotary_factor beside rope_theta."""
    older = {k: v for k, v in QWEN3_5.items() if k not in ("layer_types", "rope_parameters")}
    older |= {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8}
    older |= {"full_attention_interval": 4, "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    older |= {"num_experts": 0, "num_experts_per_tok": 1, "moe_intermediate_size": 8}
    config = ModelConfig.from_dict(older)
    assert [config.is_linear(i) for i in range(8)] == [True, True, True, False] * 2
    assert config.rotary_dim == 4 and config.rope_theta == 1e7
    assert KVGroups.of(config).layers == ((3, 7),)


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["introduce"] * 4 + ["compute"] * 3 + ["finish"] * 2 + ["restart"]),
        st.integers(0, 2 * MIN_SLOTS),  # enough live sequences to grow the slots
    ),
    min_size=30,
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(OPERATIONS)
def test_every_live_sequence_keeps_its_own_state_whatever_comes_and_goes(operations):
    """Sequences introduced, computed, finished, preempted (finished and introduced again)
    and a restart (every one forgotten), in any order: each live sequence has a slot of its
    own, holds exactly what it computed (no other's introduction, growth or zeroing touches
    it), starts from zeros when (re)introduced, and the slots never outgrow twice the most
    sequences held at once (or the first allocation)."""
    state = RecurrentState(ModelConfig.from_dict(QWEN3_5), torch.float32, torch.device("cpu"))
    table = SeqTable(PlanLimits(4, 64, 256, 64), torch.device("cpu"))
    table.slot_given = state.give
    computed: dict[int, float] = {}  # live sequence -> the value its state holds
    most = 0
    for operation, seq_id in operations:
        if operation == "introduce":
            introduce(table, seq_id, finished=(seq_id,))  # new, or preempted and recomputed
            computed[seq_id] = 0.0
        elif operation == "finish":
            table.apply(StepPlan(0, [], [], finished=[seq_id]))
            computed.pop(seq_id, None)
        elif operation == "compute" and seq_id in computed:
            computed[seq_id] = float(seq_id + 1 + len(computed))
            for layer in state.layers:
                state.recurrent[layer][table.seq(seq_id).slot].fill_(computed[seq_id])
                state.conv[layer][table.seq(seq_id).slot].fill_(computed[seq_id])
        elif operation == "restart":
            table.clear()
            computed.clear()
        most = max(most, len(computed))
        slots = {seq_id: table.seq(seq_id).slot for seq_id in computed}
        assert len(set(slots.values())) == len(slots)
        for seq_id, value in computed.items():
            for layer in state.layers:
                assert bool((state.recurrent[layer][slots[seq_id]] == value).all())
                assert bool((state.conv[layer][slots[seq_id]] == value).all())
        assert state.num_slots <= max(MIN_SLOTS, 2 * most)
