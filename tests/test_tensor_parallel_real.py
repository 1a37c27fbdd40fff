"""Tensor parallelism on the default model (issue 33): SmolLM2-135M-Instruct, 9 heads and
3 KV heads, split over three gloo ranks gives in float32 on the CPU transformers' greedy
continuations of varied prompts and its logits at each prompt's last row, and each rank's
KV cache holds its one KV head.

Each rank runs its shard's ModelRunner over its paged KV cache: a prefill of the prompt,
then a decode step per token. Rank 0 samples each token and broadcasts it to the others,
as it will hand its followers the next plan; the others' samples, each of its own slice of
the vocabulary, are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.runner import ModelRunner
from gpu_worker.tensor_parallel import Shard
from service.tokenizer import Tokenizer
from tests.tensor_parallel_helpers import NUM_BLOCKS, build_runner, run_ranks
from tests.worker_fixtures import Chunk, blocks_for, hf_model, max_diff, plan_for

pytestmark = pytest.mark.real_model

WORLD = 3
NEW_TOKENS = 16
# name: chat messages (templated) or plain text
PROMPTS: dict[str, list[dict[str, str]] | str] = {
    "chat question": [{"role": "user", "content": "Why is the sky blue?"}],
    "chat with a system prompt": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a use of copper."},
    ],
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "plain text": "The printing press, invented by Johannes Gutenberg around 1440,",
}
BLOCKS_PER_PROMPT = NUM_BLOCKS // len(PROMPTS)  # each prompt its own blocks
# float32 logits of TP=3 against transformers: the TP=1 test's bound on this model
# (tests/test_worker_real_model.py); splitting each matmul in three only reorders sums.
LOGITS_TOLERANCE = 1e-4  # of the largest |logit|


def prompt_ids(model_dir: Path) -> dict[str, list[int]]:
    tokenizer = Tokenizer.from_dir(model_dir)
    return {
        name: tokenizer.encode(
            prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(prompt)
        )
        for name, prompt in PROMPTS.items()
    }


def transformers_results(
    model_dir: Path, prompts: dict[str, list[int]]
) -> dict[str, dict[str, Any]]:
    """Each prompt's greedy tokens, the logits of its last row and the least lead of a
    chosen token over the runner-up."""
    hf, results = hf_model(model_dir), {}
    with torch.no_grad():
        for name, prompt in prompts.items():
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
            leads = [float(-torch.topk(step[0], 2).values.diff()) for step in out.logits]
            results[name] = {
                "tokens": out.sequences[0, len(prompt) :].tolist(),
                "logits": out.logits[0][0],  # the prefill's last row
                "least_lead": min(leads),
            }
    return results


# ---- the ranks ------------------------------------------------------------------------------


def split_results(shard: Shard, model_dir: str, prompts: dict[str, list[int]]) -> dict:
    """One spawned rank's greedy run of each prompt, and on rank 0 every rank's KV heads of
    each layer's K and V (tensor_parallel_helpers.run_ranks)."""
    runner = build_runner(Path(model_dir), torch.float32, shard)
    heads = torch.tensor([t.shape[0] for kv in runner.cache.layers for t in (kv.k, kv.v)])
    results: dict[str, Any] = {"kv_heads": shard.gather(heads)}
    for seq_id, (name, prompt) in enumerate(prompts.items()):
        table = blocks_for(seq_id * BLOCKS_PER_PROMPT, len(prompt) + NEW_TOKENS)
        results[name] = greedy(runner, shard, Chunk(seq_id, prompt, 0, table))
    return results


def greedy(runner: ModelRunner, shard: Shard, prompt: Chunk) -> dict[str, Any]:
    """The prefill's last-row logits (on rank 0; the others' are of their slice) and
    NEW_TOKENS greedy tokens, rank 0's choices."""
    logits = runner.step_logits(plan_for(runner, [prompt]))[0]
    step, tokens = prompt, []
    for step_id in range(NEW_TOKENS):
        result = runner.execute(plan_for(runner, [step], step_id))
        assert result.error is None, result.error
        tokens.append(int(shard.broadcast(torch.tensor(result.tokens[0]))))
        position = len(prompt.tokens) + len(tokens) - 1
        step = Chunk(prompt.seq_id, tokens[-1:], position, prompt.table)
    return {"logits": logits, "tokens": tokens}


@pytest.fixture(scope="module")
def runs(default_model_dir, tmp_path_factory) -> dict[str, Any]:
    prompts = prompt_ids(default_model_dir)
    expected = transformers_results(default_model_dir, prompts)
    workdir = tmp_path_factory.mktemp("ranks")
    split = run_ranks(split_results, (str(default_model_dir), prompts), WORLD, workdir)
    return {"tokenizer": Tokenizer.from_dir(default_model_dir), "hf": expected, "tp3": split}


# ---- the checks -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_continuations_equal_transformers(runs, name):
    expected, got = runs["hf"][name], runs["tp3"][name]["tokens"]
    text = runs["tokenizer"].decode(got)
    print(f"\n{name}: {text!r}, least lead {expected['least_lead']:.3f}")
    assert len(expected["tokens"]) == NEW_TOKENS
    assert got == expected["tokens"]


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_agree_with_transformers(runs, name):
    expected, got = runs["hf"][name]["logits"], runs["tp3"][name]["logits"]
    assert got.shape == expected.shape
    print(f"\n{name}: max |logit difference| {max_diff(got, expected):.2e}")
    assert max_diff(got, expected) < LOGITS_TOLERANCE * expected.abs().max().item()


def test_each_rank_caches_one_kv_head(runs):
    """3 KV heads over 3 ranks: every layer's K and V on every rank hold one."""
    per_rank = runs["tp3"]["kv_heads"]
    assert len(per_rank) == WORLD
    assert all(heads.tolist() == [1] * len(heads) for heads in per_rank)
