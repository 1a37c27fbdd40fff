"""A follower rank's step (ModelRunner.follow) makes every collective rank 0's makes
(ModelRunner.execute), whatever the plan asks: prompt log-probabilities over several
chunks of PROMPT_ROWS, a pooled sequence, n-gram drafts verified, a decode batch, a
sampled step with logprobs; and a plan both reject fails on both without a collective,
the group serving on. Two gloo ranks of a tiny float32 Llama answer what one rank does.
"""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpu_worker.protocol import POOL_LAST, SamplingSpec, StepPlan, StepResult
from gpu_worker.runner import PROMPT_ROWS, ModelRunner
from gpu_worker.tensor_parallel import NO_SHARD, Shard
from tests.tensor_parallel_helpers import NUM_BLOCKS, build_runner, run_ranks
from tests.worker_fixtures import Chunk, blocks_for, plan_for, random_prompt

WORLD = 2
PROMPT = random_prompt(PROMPT_ROWS + 40, seed=31)  # its targets take two chunks
POOLED = random_prompt(21, seed=32)
ECHO = SamplingSpec(prompt_logprobs=2, logprobs=True, top_logprobs=2)


def plans(runner: ModelRunner) -> list[StepPlan]:
    """A prefill with prompt log-probabilities beside a pooled prompt; the first
    sequence's decode with two n-gram drafts; a decode batch of it and a new one; a plan
    whose block lies beyond the cache."""
    echo_table, other = blocks_for(0, len(PROMPT) + 8), blocks_for(40, 32)
    first = plan_for(
        runner,
        [
            Chunk(0, PROMPT, 0, echo_table, spec=ECHO, prompt_targets=PROMPT[1:]),
            Chunk(1, POOLED, 0, blocks_for(80, len(POOLED)), sample=False, pooling=POOL_LAST),
        ],
        0,
    )
    drafting = Chunk(0, [5, 9, 11], len(PROMPT), echo_table, spec=ECHO, drafts=[9, 11])
    drafted = plan_for(runner, [drafting], 1)
    batch = plan_for(
        runner,
        [
            Chunk(0, [3], len(PROMPT) + 3, echo_table, spec=ECHO),
            Chunk(2, POOLED[:5], 0, other, spec=ECHO),
        ],
        2,
    )
    beyond = plan_for(runner, [Chunk(3, [4, 4], 0, [NUM_BLOCKS + 5])], 3)
    return [first, drafted, batch, beyond]


def comparable(result: StepResult) -> dict[str, Any]:
    found = dataclasses.asdict(result)
    found.pop("step_ms")
    found.pop("idle_ms")
    return found


def followed(shard: Shard, model_dir: str) -> dict[str, Any]:
    """One spawned rank's run of plans(): rank 0 executes them, the other follows; rank
    0 gets its results and every rank's step errors."""
    runner = build_runner(Path(model_dir), torch.float32, shard)
    results, errors = [], []
    for plan in plans(runner):
        if shard.rank == 0:
            result = runner.execute(plan)
            results.append(comparable(result))
            errors.append(result.error)
        else:
            errors.append(runner.follow(plan))
    every = [None] * shard.world_size if shard.rank == 0 else None
    dist.gather_object(errors, every, dst=0)
    tables = [None] * shard.world_size if shard.rank == 0 else None
    dist.gather_object(held(runner), tables, dst=0)
    return {"results": results, "errors": every, "tables": tables}


def held(runner: ModelRunner) -> dict[int, Any]:
    """What a rank holds of each sequence: its facts and its block table's ids."""
    table = runner.table
    return {
        seq_id: (dataclasses.asdict(table.seq(seq_id)), table.table(seq_id))
        for seq_id in range(4)
        if seq_id in table
    }


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tmp_path_factory) -> dict[str, Any]:
    single = build_runner(tiny_llama_dir, torch.float32, NO_SHARD)
    alone = [comparable(single.execute(plan)) for plan in plans(single)]
    split = run_ranks(followed, (str(tiny_llama_dir),), WORLD, tmp_path_factory.mktemp("ranks"))
    return {"tp1": alone, **split}


def test_rank_0_answers_every_step_as_one_rank_does(runs):
    for step, (got, expected) in enumerate(zip(runs["results"], runs["tp1"], strict=True)):
        assert got["tokens"] == expected["tokens"], step
        assert got["error"] == expected["error"], step
        for name in ("logprobs", "prompt_logprobs"):
            assert (got[name] is None) == (expected[name] is None), (step, name)
    echoed = runs["results"][0]["prompt_logprobs"][0]
    reference = runs["tp1"][0]["prompt_logprobs"][0]
    assert len(echoed["logprobs"]) == len(PROMPT) - 1
    assert echoed["top_ids"] == reference["top_ids"]
    gaps = [abs(a - b) for a, b in zip(echoed["logprobs"], reference["logprobs"], strict=True)]
    assert max(gaps) < 1e-4


def test_drafts_are_verified_and_the_pooled_vector_matches(runs):
    drafted, reference = runs["results"][1], runs["tp1"][1]
    assert drafted["tokens"] == reference["tokens"] and 1 <= len(drafted["tokens"][0]) <= 3
    pooled = runs["results"][0]["pooled"][1]
    expected = runs["tp1"][0]["pooled"][1]
    assert pooled is not None and expected is not None
    got, want = (vector(text) for text in (pooled, expected))
    assert torch.allclose(got, want, atol=1e-5)


def test_followers_hold_the_same_table_as_rank_0(runs):
    rank0, rank1 = runs["tables"]
    assert sorted(rank0) == [0, 1, 2]  # the plan beyond the cache introduced nobody
    assert rank0 == rank1
    assert rank0[0][1] == blocks_for(0, len(PROMPT) + 8)


def test_a_plan_both_reject_fails_on_both_and_the_group_serves_on(runs):
    rank0, rank1 = runs["errors"]
    assert rank0[:3] == [None, None, None] and rank1[:3] == [None, None, None]
    assert rank0[3] is not None and rank0[3] == rank1[3]


def vector(text: str) -> torch.Tensor:
    """A pooled vector (StepResult.pooled): base64 of little-endian float64s."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.float64)
