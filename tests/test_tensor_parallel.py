"""Tensor parallelism on the CPU (gpu_worker.tensor_parallel): tiny models split over two
gloo ranks give TP=1's float32 logits on a prefill, a prefill chunk, a decode batch and a
mixed batch, TP=1's greedy tokens, and in bfloat16 TP=1's rule for the refined logits;
each step makes exactly the collectives the split promises, and TP=1 none.

The models: a Llama; a Qwen2 with q/k/v biases, tied embeddings and a vocabulary of 251
(padded to 252 for two ranks); Gemma 3 (q/k norms, Gemma's norms, embedding scale, soft
capping, three KV groups); Phi-3 (q/k/v and gate/up fused in the checkpoint). The ranks
are spawned once for all of them, and compared with the TP=1 runs made here.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpu_worker.checkpoint import StoredTensor, load_weights
from gpu_worker.kernels import reference
from gpu_worker.model import REFINED_LOGITS, Model
from gpu_worker.model_config import ModelConfig
from gpu_worker.quant import QuantLinear
from gpu_worker.runner import ModelRunner
from gpu_worker.tensor_parallel import (
    NO_SHARD,
    VOCAB,
    Shard,
    check_shardable,
    fused_rows,
)
from tests.tensor_parallel_helpers import CPU, build_runner, run_ranks
from tests.worker_fixtures import Chunk, blocks_for, max_diff, plan_for

WORLD = 2
# name: (kind, overrides, quantization)
MODELS = {
    "llama": ("llama", {}, "none"),
    "llama-int8": ("llama", {}, "int8"),
    "qwen2-tied-padded": ("qwen2", {"tie_word_embeddings": True, "vocab_size": 251}, "none"),
    "gemma3": ("gemma3", {}, "none"),
    "phi3": ("phi3", {}, "none"),
}
GREEDY_STEPS = 8
COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "all_gather_into_tensor",
    "broadcast",
    "gather",
    "all_gather",
    "reduce",
    "scatter",
)
# Shard.all_reduce: an all-gather summed in rank order
ALL_REDUCE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


# ---- what the parent (TP=1) and each rank (TP=2) run alike ---------------------------------


def token_ids(length: int, seed: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


def planned_steps(vocab: int) -> list[tuple[str, list[Chunk], bool]]:
    """(name, the step's sequences, whether every row's logits are read: a prompt's
    log-probabilities read them so)."""
    first, second, third = (token_ids(n, seed=n, vocab=vocab) for n in (37, 20, 15))
    tables = [blocks_for(16 * seq, 64) for seq in range(3)]
    return [
        ("prefill", [Chunk(0, first, 0, tables[0])], True),
        ("prefill beside", [Chunk(1, second, 0, tables[1])], False),
        ("decode batch", [Chunk(0, [5], 37, tables[0]), Chunk(1, [6], 20, tables[1])], False),
        (
            "mixed batch",
            [
                Chunk(0, [7], 38, tables[0]),
                Chunk(1, [8], 21, tables[1]),
                Chunk(2, third[:9], 0, tables[2]),
            ],
            False,
        ),
        ("prefill chunk", [Chunk(2, third[9:], 9, tables[2])], True),
    ]


def step_logits(runner: ModelRunner, seqs: list[Chunk], every_row: bool) -> torch.Tensor:
    """float32 logits of the sampling rows, or of every row."""
    plan = plan_for(runner, seqs)
    if not every_row:
        return runner.step_logits(plan)
    return runner.model.logits(runner.forward(runner.inputs(plan))).dense()


def greedy_tokens(runner: ModelRunner, forced: list[int] | None) -> list[int]:
    """A sequence's greedy tokens, each step fed the last one chosen, or `forced`'s: the
    ranks are fed TP=1's, so that each of their choices is made on TP=1's inputs."""
    vocab = runner.model.config.vocab_size
    table = blocks_for(48, 12 + GREEDY_STEPS)
    tokens, start, chosen = token_ids(12, seed=7, vocab=vocab), 0, []
    for step in range(GREEDY_STEPS):
        result = runner.execute(plan_for(runner, [Chunk(3, tokens, start, table)], step))
        assert result.error is None, result.error
        chosen.append(result.tokens[0][0])
        start += len(tokens)
        tokens = [chosen[-1] if forced is None else forced[step]]
    return chosen


def float32_results(
    runner: ModelRunner, counts: Counter[str], forced: list[int] | None
) -> dict[str, Any]:
    """Each step's logits and collectives, the KV heads the cache holds, greedy tokens."""
    logits, made = {}, {}
    for name, seqs, every_row in planned_steps(runner.model.config.vocab_size):
        before = Counter(counts)
        logits[name] = step_logits(runner, seqs, every_row)
        made[name] = dict(counts - before)
    kv_heads = runner.cache.like.shape[0]
    return {
        "logits": logits,
        "counts": made,
        "kv_heads": kv_heads,
        "greedy": greedy_tokens(runner, forced),
    }


def bfloat16_results(runner: ModelRunner, counts: Counter[str]) -> dict[str, Any]:
    """A bfloat16 prefill's hidden states and what logits made of them, with the
    collectives of the forward pass and the logits."""
    prompt = token_ids(23, seed=5, vocab=runner.model.config.vocab_size)
    plan = plan_for(runner, [Chunk(0, prompt, 0, blocks_for(0, len(prompt)))])
    before = Counter(counts)
    hidden = runner.forward(runner.inputs(plan))
    logits = runner.model.logits(hidden)
    return {
        "hidden": hidden,
        "values": logits.values,
        "top": logits.top,
        "top_values": logits.top_values,
        "counts": dict(counts - before),
    }


def model_results(
    served: tuple[str, str], shard: Shard, counts: Counter[str], forced: list[int] | None
) -> dict[str, Any]:
    """`served`: (model directory, quantization)."""
    model_dir, quantization = Path(served[0]), served[1]
    runner = build_runner(model_dir, torch.float32, shard, quantization)
    results = float32_results(runner, counts, forced)
    runner = build_runner(model_dir, torch.bfloat16, shard, quantization)
    results["bfloat16"] = bfloat16_results(runner, counts)
    return results


def count_collectives(patch: Callable[[str, Any], Any]) -> Counter[str]:
    """Counts each torch.distributed collective's calls from here on; `patch(name, f)`
    puts f in place of torch.distributed's `name`."""
    counts: Counter[str] = Counter()
    for name in COLLECTIVES:
        patch(name, _counted(getattr(dist, name), name, counts))
    return counts


def _counted(collective: Callable[..., Any], name: str, counts: Counter[str]) -> Callable:
    @functools.wraps(collective)
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return collective(*args, **kwargs)

    return counted


# ---- the ranks ------------------------------------------------------------------------------


def split_results(
    shard: Shard, models: dict[str, tuple[str, str]], forced: dict[str, list[int]]
) -> dict[str, dict[str, Any]]:
    """One spawned rank's results of every model (tensor_parallel_helpers.run_ranks)."""
    counts = count_collectives(functools.partial(setattr, dist))
    return {
        name: model_results(served, shard, counts, forced[name]) for name, served in models.items()
    }


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Each model's directory, its TP=1 results (made here, where no collective may run)
    and TP=2's."""
    models = {
        name: (str(tiny_models(kind, **overrides)), quantization)
        for name, (kind, overrides, quantization) in MODELS.items()
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            counts = count_collectives(functools.partial(monkeypatch.setattr, dist))
            single = {
                name: model_results(served, NO_SHARD, counts, None)
                for name, served in models.items()
            }
    finally:
        torch.set_num_threads(threads)
    assert not counts, f"TP=1 ran collectives: {dict(counts)}"
    forced = {name: results["greedy"] for name, results in single.items()}
    split = run_ranks(split_results, (models, forced), WORLD, tmp_path_factory.mktemp("ranks"))
    return {
        name: {"served": models[name], "tp1": single[name], "tp2": split[name]} for name in MODELS
    }


# ---- the checks -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_logits_equal_tp1(runs, name):
    tp1, tp2 = runs[name]["tp1"], runs[name]["tp2"]
    for step, reference_logits in tp1["logits"].items():
        logits = tp2["logits"][step]
        assert logits.shape == reference_logits.shape, step
        assert max_diff(logits, reference_logits) < 1e-5, step
        assert torch.equal(logits.argmax(-1), reference_logits.argmax(-1)), step


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_steps_equal_tp1(runs, name):
    assert runs[name]["tp2"]["greedy"] == runs[name]["tp1"]["greedy"]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_caches_its_kv_heads(runs, name):
    assert runs[name]["tp2"]["kv_heads"] * WORLD == runs[name]["tp1"]["kv_heads"]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_step_makes_2l_plus_1_all_reduces_and_one_gather(runs, name):
    layers = ModelConfig.from_dir(runs[name]["served"][0]).num_hidden_layers
    for step, made in runs[name]["tp2"]["counts"].items():
        assert made == {ALL_REDUCE: 2 * layers + 1, "gather": 1}, step


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_refined_logits_follow_tp1s_rule(runs, name):
    """Rank 0's top ids are those TP=1's op picks from the gathered logits, and their
    float32 logits are TP=1's: the float64 dot products of the head's rows (served in
    bfloat16) with the same hidden states, soft-capped where the model caps."""
    model_dir, quantization = runs[name]["served"]
    tp1 = build_runner(Path(model_dir), torch.bfloat16, NO_SHARD, quantization).model
    got = runs[name]["tp2"]["bfloat16"]
    hidden, top = got["hidden"], got["top"]
    assert got["values"].shape == (hidden.shape[0], tp1.config.vocab_size)
    assert torch.equal(top, tp1.ops.top_k_ids(got["values"], REFINED_LOGITS))
    exact = (served_rows(tp1, top).double() * hidden.double().unsqueeze(1)).sum(-1).float()
    cap = tp1.config.final_logit_softcapping
    expected = exact if cap is None else torch.tanh(exact / cap) * cap
    assert torch.equal(got["top_values"], expected)
    reference_values = tp1.logits(hidden).values
    assert max_diff(got["values"], reference_values) <= 2**-6 * reference_values.abs().max()
    layers = tp1.config.num_hidden_layers
    assert got["counts"] == {ALL_REDUCE: 2 * layers + 1, "gather": 2, "broadcast": 1}


def served_rows(model: Model, ids: torch.Tensor) -> torch.Tensor:
    """The LM head's rows `ids` as TP=1 serves them: a quantized head's dequantized."""
    if isinstance(model.lm_head, QuantLinear):
        return model.lm_head.dequantized_rows(ids)
    assert model.lm_head_rows is not None
    return model.lm_head_rows[ids]


# ---- refused at start, and the slicing rules ------------------------------------------------


def test_tp2_is_refused_for_9_heads_and_3_kv_heads():
    config = ModelConfig.from_dict(SMOLLM2_135M)
    message = (
        "tensor parallel size 2 does not divide the model's 9 attention heads, "
        "3 key/value heads: .* sizes that fit this model: 1, 3"
    )
    with pytest.raises(ValueError, match=message):
        Model(
            config,
            {},
            max_positions=16,
            dtype=torch.float32,
            device=CPU,
            kernels=reference(),
            shard=Shard(rank=0, world_size=2),
        )
    check_shardable(config, 3)


def test_mixtures_of_experts_and_gguf_weights_are_refused():
    mixtral = {
        **SMOLLM2_135M,
        "architectures": ["MixtralForCausalLM"],
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    with pytest.raises(ValueError, match="does not split a mixture of experts"):
        check_shardable(ModelConfig.from_dict(mixtral), 2)
    llama = ModelConfig.from_dict(
        {**SMOLLM2_135M, "num_attention_heads": 8, "num_key_value_heads": 4}
    )
    with pytest.raises(ValueError, match="GGUF"):
        check_shardable(llama, 2, "gguf")
    check_shardable(llama, 2, "int8")


def test_fused_parts_are_each_sliced_and_the_vocabulary_padded():
    qkv = torch.arange(8.0).repeat_interleave(2).view(8, 2)  # q rows 0..3, k 4..5, v 6..7
    second = Shard(rank=1, world_size=2)
    assert second.slice(qkv, fused_rows(4, 2, 2))[:, 0].tolist() == [2, 3, 5, 7]
    vocab = torch.arange(5.0).view(5, 1)
    assert second.slice(vocab, VOCAB)[:, 0].tolist() == [3, 4, 0]
    assert Shard(rank=0, world_size=2).slice(vocab, VOCAB)[:, 0].tolist() == [0, 1, 2]


def test_a_rank_reads_only_its_slices_of_the_split_weights(tiny_models, monkeypatch):
    """Built from weights read on use, rank 1 of 2 reads whole only the weights every
    rank keeps whole (the norms), and keeps what it keeps from eagerly read weights."""
    model_dir = tiny_models("qwen2")  # biases, sliced as their weights
    config = ModelConfig.from_dir(model_dir)
    read_whole: list[tuple[int, ...]] = []
    whole_read = StoredTensor.to

    def recorded(self, device, dtype):
        read_whole.append(tuple(self.shape))
        return whole_read(self, device, dtype)

    monkeypatch.setattr(StoredTensor, "to", recorded)
    shard = Shard(rank=1, world_size=2)

    def built(on_use: bool) -> dict[str, torch.Tensor]:
        weights = load_weights(model_dir, torch.float32, on_use=on_use)
        model = Model(
            config,
            weights,
            max_positions=32,
            dtype=torch.float32,
            device=CPU,
            kernels=reference(),
            shard=shard,
        )
        return tensors_of(model)

    on_use, eager = built(True), built(False)
    assert read_whole and all(shape == (config.hidden_size,) for shape in read_whole)
    assert on_use.keys() == eager.keys()
    assert all(torch.equal(on_use[name], eager[name]) for name in eager)


def tensors_of(root: Any) -> dict[str, torch.Tensor]:
    """Every tensor reachable from `root`'s attributes, lists and dicts, by path."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(value: Any, path: str) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]")
        elif hasattr(value, "__dict__") or hasattr(value, "__slots__"):
            names = list(getattr(value, "__dict__", {})) + list(getattr(value, "__slots__", ()))
            for name in names:
                if hasattr(value, name):
                    visit(getattr(value, name), f"{path}.{name}")

    visit(root, "model")
    return found


DTYPES_SUMMED = ("bfloat16", "float32")


def summed_rows(shard: Shard, rows: int, width: int) -> dict[str, dict[str, torch.Tensor]]:
    """One spawned rank's partial sums of `rows` rows in each of DTYPES_SUMMED, all-reduced
    whole and each row alone, and every rank's whole result (on rank 0);
    torch.distributed's ring all-reduce of the same, for contrast."""
    found = {}
    for dtype in DTYPES_SUMMED:
        generator = torch.Generator().manual_seed(shard.rank)
        parts = torch.randn(rows, width, generator=generator).to(getattr(torch, dtype))
        ring = parts.clone()
        dist.all_reduce(ring)
        whole = shard.all_reduce(parts.clone())
        found[dtype] = {
            "whole": whole,
            "every": torch.stack(shard.gather(whole) or [whole]),
            "alone": torch.cat([shard.all_reduce(parts[i : i + 1].clone()) for i in range(rows)]),
            "ring": ring,
            "parts": torch.stack([p.float() for p in shard.gather(parts)] or [parts.float()]),
        }
    return found


def test_an_all_reduced_row_does_not_depend_on_its_batch_at_3_ranks(tmp_path):
    """Three ranks, in bfloat16 and float32: a row summed within 64 rows has the bits it
    has summed alone, the float32 sum of its parts in rank order rounded once, on every
    rank; a ring all-reduce's does not."""
    runs = run_ranks(summed_rows, (64, 576), 3, tmp_path)
    for dtype in DTYPES_SUMMED:
        got = runs[dtype]
        assert torch.equal(got["whole"], got["alone"]), dtype
        in_order = (got["parts"][0] + got["parts"][1] + got["parts"][2]).to(got["whole"].dtype)
        assert torch.equal(got["whole"], in_order), dtype
        assert all(torch.equal(rank, got["whole"]) for rank in got["every"]), dtype  # every rank's
        print(
            dtype,
            "ring all-reduce, most apart from the ordered sum:",
            max_diff(got["ring"], in_order),
        )
