"""Decode-only steps padded to batch buckets: same results, no KV outside the scratch block."""

from __future__ import annotations

from gpu_worker.graphs import batch_buckets, smallest_fitting, width_buckets
from tests.worker_fixtures import (
    Chunk,
    blocks_for,
    make_plan,
    make_runner,
    max_diff,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    random_prompt,
    tiny_llama_dir,  # noqa: F401 (fixture)
)


def test_batch_buckets_follow_the_documented_ladder():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert batch_buckets(1) == [1]
    assert smallest_fitting(5, batch_buckets(64)) == 8
    assert smallest_fitting(65, batch_buckets(64)) is None
    assert width_buckets(20) == [1, 2, 4, 8, 16, 20]


def _prefill(runner, seq_id: int, prompt: list[int], table: list[int]) -> int:
    result = runner.execute(make_plan([Chunk(seq_id, prompt, 0, table)]))
    assert result.error is None, result.error
    return result.tokens[0]


def test_padded_decode_batch_matches_unpadded_and_touches_no_other_kv(tiny_llama_dir):  # noqa: F811
    runner = make_runner(tiny_llama_dir)
    assert 8 in runner.handshake.decode_buckets and 5 not in runner.handshake.decode_buckets
    prompts = [random_prompt(6 + 3 * i, seed=40 + i) for i in range(5)]
    tables = [blocks_for(20 * i, 40) for i in range(5)]
    firsts = [
        _prefill(runner, i, p, t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    # A bystander sequence whose blocks must stay untouched by the padded rows.
    bystander_table = blocks_for(200, 30)
    _prefill(runner, 99, random_prompt(30, seed=50), bystander_table)

    caches = runner.cache.layers
    before = [(kv.k.clone(), kv.v.clone()) for kv in caches]
    decodes = [Chunk(i, [firsts[i]], len(prompts[i]), tables[i]) for i in range(len(prompts))]
    padded_logits = runner.step_logits(make_plan(decodes))  # 5 rows, run as a bucket of 8

    written = {(t[len(p) // 4], len(p) % 4) for p, t in zip(prompts, tables, strict=True)}
    scratch = runner.cache.scratch_block
    for (k_before, v_before), after in zip(before, caches, strict=True):
        for before_t, after_t in ((k_before, after.k), (v_before, after.v)):
            changed = (before_t != after_t).any(dim=(0, 3)).nonzero().tolist()
            touched = {(block, slot) for block, slot in changed}
            assert touched - {(scratch, 0)} <= written
            assert not touched & {(b, s) for b in bystander_table for s in range(4)}

    # The same decodes one at a time (bucket 1: no padding) give the same logits.
    for layer, (k_before, v_before) in zip(caches, before, strict=True):
        layer.k.copy_(k_before)
        layer.v.copy_(v_before)
    for i, chunk in enumerate(decodes):
        alone = runner.step_logits(make_plan([chunk]))[0]
        assert max_diff(padded_logits[i], alone) < 1e-4 * max(1.0, alone.abs().max().item())


def test_decode_batch_beyond_the_largest_bucket_runs_unpadded(tiny_llama_dir):  # noqa: F811
    runner = make_runner(tiny_llama_dir, max_num_seqs=2)
    tables = [blocks_for(10 * i, 12) for i in range(3)]
    firsts = [_prefill(runner, i, random_prompt(5, seed=i), tables[i]) for i in range(3)]
    plan = make_plan([Chunk(i, [firsts[i]], 5, tables[i]) for i in range(3)])
    result = runner.execute(plan)
    assert result.error is None and len(result.tokens) == 3


def test_decode_steps_where_only_some_rows_sample(tiny_llama_dir):  # noqa: F811
    runner = make_runner(tiny_llama_dir)
    tables = [blocks_for(10 * i, 12) for i in range(3)]
    firsts = [_prefill(runner, i, random_prompt(5, seed=i), tables[i]) for i in range(3)]
    expected = runner.step_logits(make_plan([Chunk(2, [firsts[2]], 5, tables[2])]))[0]
    plan = make_plan(
        [Chunk(i, [firsts[i]], 5, tables[i], sample=i == 2) for i in range(3)], step_id=7
    )
    result = runner.execute(plan)
    assert result.error is None
    assert result.seq_ids == [2] and result.step_id == 7
    assert result.tokens == [int(expected.argmax())]
