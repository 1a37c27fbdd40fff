"""Loading, KV cache sizing, and plan validation of the model runner."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gpu_worker import kernel_choice, kv_cache, linear, memory, runtime
from gpu_worker.checkpoint import CheckpointError, load_weights
from gpu_worker.model_config import ConfigError, ModelConfig, UnsupportedModel
from gpu_worker.protocol import POOL_LAST, WorkerConfig, block_size_for
from tests.worker_fixtures import (
    BLOCK_SIZE,
    Chunk,
    blocks_for,
    make_plan,
    make_runner,
    random_prompt,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "eos_token_id": [2, 7],
}


def config_with(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**BASE_CONFIG, **changes})


def test_config_parses_defaults_and_variants():
    config = config_with()
    assert (config.head_dim, config.group_size) == (16, 2)
    assert config.rope_scaling is None and not config.attention_bias
    qwen = config_with(architectures=["Qwen2ForCausalLM"], sliding_window=4096)
    assert qwen.attention_bias and qwen.layer_windows == ()  # no use_sliding_window: none
    mistral = config_with(architectures=["MistralForCausalLM"], sliding_window=64)
    assert mistral.layer_windows == (64, 64) and mistral.context_limit == 2048  # not capped
    assert mistral.sliding_window == 64  # every layer's: the service frees blocks before it
    windowed = config_with(
        architectures=["Qwen2ForCausalLM"],
        sliding_window=32,
        use_sliding_window=True,
        max_window_layers=1,
    )
    assert windowed.layer_windows == (None, 32)


def test_smollm3_configs_give_every_fourth_layer_no_rope_unless_they_list_them():
    smollm3 = {"architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8}
    default = config_with(**smollm3)
    assert [default.rope_of(i) is None for i in range(8)] == [False, False, False, True] * 2
    listed = config_with(**{**smollm3, "no_rope_layers": [1, 0, 1, 1, 0, 1, 1, 1]})
    assert listed.rope_layers == (True, False, True, True, False, True, True, True)
    assert config_with(**{**smollm3, "no_rope_layers": [1] * 8}).rope_layers == ()
    with pytest.raises(ConfigError, match="no_rope_layers lists 2 layers"):
        config_with(**{**smollm3, "no_rope_layers": [1, 0]})


def test_gemma4_text_is_causal_beside_a_vision_tower_that_attends_both_ways():
    """And its global layers' heads are global_head_dim wide, 512 where the config names
    none, as transformers' Gemma4TextConfig makes them (here every layer is global)."""
    config = config_with(architectures=["Gemma4ForCausalLM"], use_bidirectional_attention="vision")
    assert config.family.gemma4 and config.attention_scale == 1.0
    assert config.head_dim == 512 and config.layer_head_dims == ()


def test_gemma3_configs_old_and_new_give_each_layer_its_window_and_rope():
    common = {**BASE_CONFIG, "num_hidden_layers": 7, "sliding_window": 512}
    old = ModelConfig.from_dict(
        {
            **common,
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 256,
        }
    )
    assert old.layer_windows == (512,) * 5 + (None, 512)
    assert old.sliding_window is None  # the global layers see every block
    local, full = old.rope_of(0), old.rope_of(5)
    assert (local.theta, local.scaling) == (1e4, None)
    assert full.theta == 1e6 and full.scaling.factor == 8.0
    assert old.attention_scale == 256**-0.5 and old.tie_word_embeddings
    new = ModelConfig.from_dict(
        {
            **common,
            "architectures": ["Gemma3ForCausalLM"],
            "layer_types": ["sliding_attention"] * 6 + ["full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        }
    )
    assert new.layer_windows == (512,) * 6 + (None,)
    assert new.rope_of(0) == local and new.rope_of(6) == full
    gemma2 = ModelConfig.from_dict({**common, "architectures": ["Gemma2ForCausalLM"]})
    assert gemma2.layer_windows == (512, None) * 3 + (512,) and gemma2.sliding_rope is None


def test_mixture_of_experts_configs_say_which_layers_route():
    qwen = ModelConfig.from_dict(
        {
            **BASE_CONFIG,
            "num_hidden_layers": 4,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "norm_topk_prob": True,
        }
    )
    assert qwen.moe.sparse_layers == (False, True, False, False)
    assert qwen.moe.renormalize and not qwen.moe.float32_weights
    mixtral = config_with(
        architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2
    )
    assert mixtral.moe.renormalize and mixtral.moe.float32_weights
    assert mixtral.moe.intermediate_size == 128
    qwen2 = {
        **BASE_CONFIG,
        "architectures": ["Qwen2MoeForCausalLM"],
        "moe_intermediate_size": 8,
        "num_experts_per_tok": 2,
    }
    assert ModelConfig.from_dict(qwen2).attention_bias  # older configs name no qkv_bias
    assert not ModelConfig.from_dict({**qwen2, "qkv_bias": False}).attention_bias
    old_style = config_with(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1e6)
    assert old_style.rope_scaling.rope_type == "linear" and old_style.rope_theta == 1e6
    new_style = config_with(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert new_style.rope_scaling is None and new_style.rope_theta == 5e5
    by_type = ModelConfig.from_dict({**BASE_CONFIG, "architectures": None, "model_type": "mistral"})
    assert by_type.architecture == "MistralForCausalLM"


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, UnsupportedModel, "GPT2LMHeadModel"),
        (
            {"architectures": ["Qwen3_5ForCausalLM"]},
            ConfigError,
            "lacks the required key 'linear_num_key_heads'",
        ),
        (
            {"architectures": None, "model_type": "qwen3_5_moe"},
            ConfigError,
            "lacks the text model's text_config",
        ),
        (
            {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
            UnsupportedModel,
            "Gemma3ForCausalLM: bidirectional",
        ),
        (
            {
                "architectures": ["Gemma4ForCausalLM"],
                "per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 3}},
            },
            UnsupportedModel,
            r"Gemma4ForCausalLM: Gemma 4's key/value heads \[2, 3\] do not divide",
        ),
        (
            {"architectures": ["Gemma4ForCausalLM"], "use_bidirectional_attention": "all"},
            UnsupportedModel,
            "Gemma4ForCausalLM: bidirectional",
        ),
        (
            {"architectures": ["Gemma4ForCausalLM"], "enable_moe_block": True},
            ConfigError,
            "lacks the required key 'num_experts'",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, UnsupportedModel, "dynamic"),
        ({"hidden_act": "relu"}, UnsupportedModel, "activation"),
        ({"partial_rotary_factor": 0.5}, UnsupportedModel, "partial"),
        ({"num_key_value_heads": 3}, UnsupportedModel, "multiple"),
        ({"hidden_size": None}, ConfigError, "malformed"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -1}}, ConfigError, "factor"),
    ],
)
def test_bad_configs_get_clear_errors(changes, error, message):
    with pytest.raises(error, match=message):
        config_with(**changes)


def test_missing_key_is_named():
    raw = dict(BASE_CONFIG)
    del raw["vocab_size"]
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig.from_dict(raw)


def test_missing_and_corrupt_files_get_clear_errors(tiny_llama_dir, tmp_path):
    import torch

    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(tmp_path / "nowhere", torch.float32)
    with pytest.raises(ConfigError, match=r"no config\.json"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_weights(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot read"):
        make_runner(broken)

    garbage = tmp_path / "garbage"
    shutil.copytree(tiny_llama_dir, garbage)
    (garbage / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="cannot read"):
        make_runner(garbage)


def test_sharded_checkpoints_load(tiny_llama_dir, tmp_path):
    import torch
    from safetensors.torch import save_file

    weights = load_weights(tiny_llama_dir, torch.float32)
    names = sorted(weights)
    halves = {"part-1.safetensors": names[::2], "part-2.safetensors": names[1::2]}
    for file_name, part in halves.items():
        save_file({n: weights[n] for n in part}, tmp_path / file_name)
    weight_map = {n: f for f, part in halves.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    sharded = load_weights(tmp_path, torch.float32)
    assert sharded.keys() == weights.keys()
    assert all(torch.equal(sharded[n], weights[n]) for n in names)

    (tmp_path / "part-2.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"part-2\.safetensors"):
        load_weights(tmp_path, torch.float32)


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    import torch
    from safetensors.torch import save_file

    weights = load_weights(tiny_llama_dir, torch.float32)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        make_runner(tmp_path)


def test_block_count_from_bytes_and_fraction():
    config = config_with()
    per_block = kv_cache.block_bytes(config, 16, __import__("torch").float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V, layers, slots, kv heads, dim, bytes
    assert kv_cache.count_blocks(float(per_block * 11), 0, per_block, 10_000) == 10
    assert kv_cache.count_blocks(0.5, per_block * 41, per_block, 10_000) == 19
    assert kv_cache.count_blocks(float(per_block * 1000), 0, per_block, 64) == 64
    with pytest.raises(kv_cache.KVCacheError, match="raise kv_memory"):
        kv_cache.count_blocks(float(per_block + 1), 0, per_block, 64)
    with pytest.raises(kv_cache.KVCacheError, match="positive"):
        kv_cache.count_blocks(-1.0, 10**9, per_block, 64)


def test_kv_budget_sets_the_profiled_activations_aside_before_the_fraction():
    gib = 1024**3
    assert kv_cache.budget_bytes(0.9, 100 * gib, 10 * gib) == int(0.9 * 90 * gib)
    assert kv_cache.budget_bytes(0.5, 40 * gib) == 20 * gib  # a CPU: nothing reserved
    assert kv_cache.budget_bytes(float(3 * gib), 1, 10 * gib) == 3 * gib  # bytes: as given
    with pytest.raises(kv_cache.KVCacheError, match="max_num_batched_tokens"):
        kv_cache.budget_bytes(0.9, 10 * gib, 10 * gib)
    # Captured graphs hold the decode peak and a mixed step's pieces (a mixed peak) in
    # their own pool, beside the eager steps' peak.
    assert kv_cache.activation_reserve(5 * gib, 2 * gib, graphs=True) == 12 * gib
    assert kv_cache.activation_reserve(5 * gib, 2 * gib, graphs=False) == 5 * gib
    per_block = 1024
    assert kv_cache.count_blocks(0.5, 41 * per_block + 1000, per_block, 10_000, 1000) == 19


def test_profile_plan_is_the_largest_step_on_one_block():
    assert memory.profile_lengths(8192, 256, 2048) == [2048, 2048, 2048, 1793] + [1] * 255
    assert memory.profile_lengths(100, 256, 2048) == [1] + [1] * 99
    assert sum(memory.profile_lengths(8192, 1, 2048)) == 8192
    plan = memory.profile_plan([7, 1, 1], block_size=4, context_limit=32)
    assert plan.start_pos == [25, 0, 0]  # the chunk ends at the context limit
    assert [row.blocks for row in plan.rows] == [[[0] * 8], [[0]], [[0]]]
    assert plan.total_tokens == 9 and all(row.sample for row in plan.rows)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_profiling_steps_run_on_a_one_block_cache(kind, tiny_models):
    """And on a hybrid model's recurrent state (the worker's, allocated before), whose
    rows the trial steps start anywhere; its warm-up steps (CUDA's) run alike."""
    import contextlib

    import torch

    from gpu_worker.warm_up import warm_up

    path = tiny_models(kind)
    runner = make_runner(path, max_num_batched_tokens=300, max_num_seqs=4)
    model = runner.model
    cache = kv_cache.allocate(model.config, 1, BLOCK_SIZE, torch.float32, model.device)
    config = WorkerConfig(str(path), max_num_batched_tokens=300, max_num_seqs=4)
    probe = runtime.runner_on(model, cache, config, runner.state)
    trials = contextlib.nullcontext() if runner.state is None else runner.state.trials()
    with trials:
        runtime.profile_mixed(probe, config)  # a 256-token chunk at the limit, 41 more, 3 decodes
        runtime.profile_decode(probe, config, width=64)
        if runner.state is not None:  # the others' warm-up is the attention's (CUDA's tests)
            warm_up(runner, 300)
    assert all(not layer.k[:, 1:].any() for layer in cache.layers)  # only block 0 is named


def test_fused_weights_leave_no_unfused_copies(tiny_llama_dir):
    import weakref

    import torch

    from gpu_worker.model import Model

    runner = make_runner(tiny_llama_dir)
    weights = load_weights(tiny_llama_dir, torch.float32)
    fused_away = [
        n
        for n in weights
        if any(p in n for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    ]
    parts = [weakref.ref(weights[n]) for n in fused_away]
    Model(
        runner.model.config,
        weights,
        max_positions=256,
        dtype=torch.float32,
        device=runner.model.device,
        kernels=runner.model.kernels,
    )
    assert fused_away and not set(fused_away) & set(weights)
    assert all(part() is None for part in parts)


def test_handshake_reports_the_cache_and_caps_the_context_by_it(tiny_llama_dir):
    per_block = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    runner = make_runner(tiny_llama_dir, kv_memory=float(per_block * 21))
    handshake = runner.handshake
    assert handshake.num_blocks == 20
    assert handshake.kv_bytes == 21 * per_block  # the scratch block included
    assert handshake.max_model_len == 20 * BLOCK_SIZE  # smaller than the model's 256
    assert (handshake.num_layers, handshake.num_kv_heads, handshake.head_dim) == (2, 2, 16)
    assert handshake.device == "cpu" and handshake.load_seconds > 0
    steps = ["config", "kernels", "weights", "cache", "graphs"]  # no profile on a CPU
    assert list(handshake.startup) == steps
    assert sum(handshake.startup.values()) <= handshake.load_seconds + 0.01


def test_the_block_size_is_the_devices_unless_one_is_asked_for(tiny_llama_dir):
    assert block_size_for(None, "cuda") == 64  # FlexAttention's 64-key tiles
    assert block_size_for(None, "cpu") == 16
    assert block_size_for(32, "cuda") == 32
    assert make_runner(tiny_llama_dir, block_size=None).handshake.block_size == 16


BAD_PLANS = {
    "never introduced": (lambda p: p.new.pop(), "finished and runs"),
    "token count": (lambda p: p.input_ids.pop(), "add up to"),
    "duplicate": (lambda p: setattr(p.rows[1], "seq_id", p.rows[0].seq_id), "more than once"),
    "block id": (lambda p: p.rows[0].blocks[0].__setitem__(0, 10_000), "block ids"),
    "short table": (lambda p: p.rows[1].blocks[0].pop(), "blocks for"),
    "gap in a table": (lambda p: setattr(p.rows[0], "blocks_at", 5), "go at entry"),
    "token id": (lambda p: p.input_ids.__setitem__(0, 256), "token ids"),
    "negative start": (lambda p: setattr(p.rows[0], "start_pos", -1), "negative"),
    "past context": (lambda p: setattr(p.rows[0], "start_pos", 10_000), "max_model_len"),
    "zero tokens": (lambda p: setattr(p.rows[0], "num_tokens", 0), "at least one"),
    "pooled and sampled": (lambda p: setattr(p.new[0], "pooling", POOL_LAST), "pooled and sampled"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plans_give_error_results_and_the_runner_keeps_working(
    tiny_llama_dir,
    case,
):
    runner = make_runner(tiny_llama_dir)
    chunks = [
        Chunk(0, random_prompt(6, seed=1), 0, blocks_for(0, 6)),
        Chunk(1, random_prompt(9, seed=2), 0, blocks_for(10, 9)),
    ]
    good = make_plan(chunks, step_id=1)
    expected = runner.execute(good)
    assert expected.error is None
    bad = make_plan(chunks, step_id=2)
    mutate, message = BAD_PLANS[case]
    mutate(bad)
    result = runner.execute(bad)
    assert result.step_id == 2 and result.tokens == []
    assert result.error is not None and message in result.error
    again = runner.execute(make_plan(chunks, step_id=3))
    assert again.error is None and again.tokens == expected.tokens


def test_an_empty_plan_is_a_valid_step(tiny_llama_dir):
    result = make_runner(tiny_llama_dir).execute(make_plan([], step_id=5))
    assert result.error is None and result.step_id == 5 and result.tokens == []


def test_bad_worker_settings_fail_at_start(tiny_llama_dir):
    with pytest.raises(ValueError, match="dtype"):
        make_runner(tiny_llama_dir, dtype="float8")
    with pytest.raises(ValueError, match="device"):
        make_runner(tiny_llama_dir, device="tpu")
    with pytest.raises(kv_cache.KVCacheError):
        make_runner(tiny_llama_dir, kv_memory=100.0)


def test_the_checked_call_sizes_are_recorded_per_machine_and_recalled(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """A first start on a machine probes each weight shape's call sizes and records them in
    the kernel cache; a later start there uses them without probing; another machine (here:
    oneDNN capped to other instructions) probes for itself."""
    cache = tmp_path / "kernels.json"
    monkeypatch.setattr(linear, "_CHECKED", {})
    make_runner(tiny_llama_dir, kernel_cache=str(cache))
    probed = linear.checked_sizes()
    assert kernel_choice.recall(cache, runtime.ROW_SIZES_SECTION) == probed

    def no_probing(*args, **kwargs):
        raise AssertionError("probed although this machine's sizes were recorded")

    monkeypatch.setattr(linear, "_CHECKED", {})
    monkeypatch.setattr(linear, "agreeing_sizes", no_probing)
    make_runner(tiny_llama_dir, kernel_cache=str(cache))
    assert linear.checked_sizes() == probed

    monkeypatch.setattr(linear, "_CHECKED", {})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernel_choice.recall(cache, runtime.ROW_SIZES_SECTION) == {}
    with pytest.raises(AssertionError, match="probed although"):
        make_runner(tiny_llama_dir, kernel_cache=str(cache))


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype int8 is not served on CUDA"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype fp8 is not served on CUDA"),
        ({"quantization": "int4"}, "quantization int4 is not served on CUDA"),
    ],
)
def test_what_the_cuda_kernels_do_not_serve_is_refused_there(
    tiny_llama_dir, monkeypatch, setting, named
):
    # on CUDA (the device as resolved: this machine has none), before anything is loaded
    monkeypatch.setattr(runtime, "resolve_device", lambda name: torch.device("cuda"))
    config = WorkerConfig(model_dir=str(tiny_llama_dir), device="cuda", **setting)
    with pytest.raises(ValueError, match=named):
        runtime._place(config, None)
    on_cpu = WorkerConfig(model_dir=str(tiny_llama_dir), **setting)
    monkeypatch.setattr(runtime, "resolve_device", lambda name: torch.device("cpu"))
    assert runtime._place(on_cpu, None).device.type == "cpu"
