"""Decode-only steps padded to batch buckets: same results, no KV outside the scratch block;
graphs captured at start-up, largest first, in one pool, over a bounded set of widths."""

from __future__ import annotations

import pytest
import torch

import gpu_worker.runtime
from gpu_worker import kernels
from gpu_worker.attention import FULL, FlexAttention
from gpu_worker.buckets import batch_buckets, on_ladder, smallest_fitting
from gpu_worker.graphs import (
    DecodeInputs,
    DecodeRunner,
    decode_forward,
    decode_slots,
    graph_capturer,
    graph_widths,
    width_buckets,
)
from gpu_worker.seq_table import PAD_SLOT
from gpu_worker.staging import gather_tables
from tests.worker_fixtures import (
    Chunk,
    blocks_for,
    make_plan,
    make_runner,
    max_diff,
    random_prompt,
    sampled,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_batch_buckets_follow_the_documented_ladder():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert batch_buckets(1) == [1]
    assert smallest_fitting(5, batch_buckets(64)) == 8
    assert smallest_fitting(65, batch_buckets(64)) is None
    assert width_buckets(20) == [1, 2, 4, 8, 16, 20]
    # The ladder itself, for kernels compiled per static batch: a worker's last bucket
    # (100 here) is padded on to the next rung.
    assert [on_ladder(n) for n in (1, 3, 24, 100, 129, 300)] == [1, 4, 24, 128, 192, 384]


def _prefill(runner, seq_id: int, prompt: list[int], table: list[int]) -> int:
    result = runner.execute(make_plan([Chunk(seq_id, prompt, 0, table)]))
    return sampled(result)[0]


def test_padded_decode_batch_matches_unpadded_and_touches_no_other_kv(tiny_llama_dir):
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


def test_decode_batch_beyond_the_largest_bucket_runs_unpadded(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir, max_num_seqs=2)
    tables = [blocks_for(10 * i, 12) for i in range(3)]
    firsts = [_prefill(runner, i, random_prompt(5, seed=i), tables[i]) for i in range(3)]
    plan = make_plan([Chunk(i, [firsts[i]], 5, tables[i]) for i in range(3)])
    result = runner.execute(plan)
    assert len(sampled(result)) == 3


def test_decode_steps_where_only_some_rows_sample(tiny_llama_dir):
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
    assert result.tokens == [[int(expected.argmax())]]


class FakeCapturer:
    """Records captures; its graphs replay by running the padded step eagerly."""

    def __init__(self, model, cache, fail=(), error="operation not permitted when capturing"):
        self.model, self.cache, self.fail, self.error = model, cache, set(fail), error
        self.pools: list[object] = []
        self.captures: list[tuple[int, int, object]] = []
        self.replays: list[tuple[int, int]] = []

    def new_pool(self):
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, batch, width, pool):
        self.captures.append((batch, width, pool))
        if (batch, width) in self.fail:
            raise RuntimeError(self.error)
        return FakeGraph(self, batch, width)


class FakeGraph:
    """Its static inputs are a real capture's; a replay runs them eagerly."""

    def __init__(self, owner, batch, width):
        self.owner, self.batch, self.width = owner, batch, width
        cache = owner.cache
        self.inputs = DecodeInputs.padding(1, batch, width, cache.scratch_block, cache.like.device)

    def replay(self):
        assert self.inputs.ints.shape == (3, self.batch)
        assert self.inputs.tables.shape == (1, self.batch, self.width)  # one KV group
        self.owner.replays.append((self.batch, self.width))
        return decode_forward(self.owner.model, self.owner.cache, self.inputs)


def decode_inputs(runner, tokens, positions, tables):
    """A decode-only step's inputs: sequence i adds tokens[i] at positions[i]."""
    rows = zip(tokens, positions, tables, strict=True)
    seqs = [Chunk(i, [t], p, table) for i, (t, p, table) in enumerate(rows)]
    return runner.inputs(make_plan(seqs))


def _decode_runner(runner, capturer, **overrides):
    settings = dict(max_num_seqs=16, max_blocks_per_seq=64, capturer=capturer)
    settings.update(overrides)
    return DecodeRunner(runner.model, runner.cache, **settings)


def test_graph_widths_stop_at_the_graph_context():
    # A 128k-token model with 16-token blocks: 10 widths (to 8,192 tokens), not 14.
    assert graph_widths(8192, 16) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert graph_widths(20, 4) == width_buckets(20)  # a short model: every width
    assert graph_widths(100, 4, max_tokens=64) == [1, 2, 4, 8, 16]


def test_capture_all_takes_every_shape_largest_batch_first_in_one_pool(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    fake = FakeCapturer(runner.model, runner.cache)
    decode = _decode_runner(runner, fake)
    report = decode.capture_all()

    shapes = [(b, w) for b, w, _ in fake.captures]
    assert shapes == sorted(shapes, reverse=True)  # largest batch, then widest, first
    assert set(shapes) == {(b, w) for b in batch_buckets(16) for w in width_buckets(64)}
    assert len(fake.pools) == 1 and all(pool is fake.pools[0] for _, _, pool in fake.captures)
    assert report["captured"] == len(shapes) and report["failed"] == []
    assert report["widths"] == width_buckets(64)


def test_a_backend_whose_cost_ignores_the_width_gets_one_graph_per_bucket(
    tiny_llama_dir, monkeypatch
):
    """FlexAttention walks each row's block list: tables padded to the longest cost it
    nothing, so one graph per bucket covers every context, the longest included."""
    offered = kernels.attention_candidates

    def with_flex(device, dtype, head_dim, layers=(FULL,)):
        return [*offered(device, dtype, head_dim, layers), FlexAttention()]

    monkeypatch.setattr(kernels, "attention_candidates", with_flex)
    runner = make_runner(tiny_llama_dir, kernels="attention=flex", kernel_cache="")
    fake = FakeCapturer(runner.model, runner.cache)
    decode = _decode_runner(runner, fake)
    report = decode.capture_all()
    assert [(b, w) for b, w, _ in fake.captures] == [(b, 64) for b in reversed(batch_buckets(16))]
    assert report["widths"] == [64]
    tables = [blocks_for(4 * i, 16) for i in range(3)]
    firsts = [_prefill(runner, i, random_prompt(10, seed=i), tables[i]) for i in range(3)]
    decode.run(decode_inputs(runner, firsts, [10] * 3, tables))  # 3 blocks of context
    assert fake.replays == [(4, 64)]


def test_a_failed_capture_runs_eagerly_and_is_never_retried(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    fake = FakeCapturer(runner.model, runner.cache, fail={(8, 4)})
    decode = _decode_runner(runner, fake)
    report = decode.capture_all()
    assert report["failed"] == [[8, 4]]
    assert report["captured"] == len(decode.shapes()) - 1

    tables = [blocks_for(4 * i, 16) for i in range(5)]
    firsts = [_prefill(runner, i, random_prompt(10, seed=i), tables[i]) for i in range(5)]
    for _ in range(3):  # 5 rows at contexts of 3 blocks: the failed shape (8, 4)
        decode.run(decode_inputs(runner, firsts, [10] * 5, tables))
    decode.run(decode_inputs(runner, firsts[:3], [10] * 3, tables[:3]))  # (4, 4) was captured
    assert fake.replays == [(4, 4)]
    assert [(b, w) for b, w, _ in fake.captures].count((8, 4)) == 1


def test_a_device_error_while_capturing_fails_the_start(tiny_llama_dir):
    """Sticky: after it the eager path would fail too, so the worker must not serve."""
    runner = make_runner(tiny_llama_dir)
    error = "CUDA error: an illegal memory access was encountered"
    fake = FakeCapturer(runner.model, runner.cache, fail={(8, 4)}, error=error)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _decode_runner(runner, fake).capture_all()


def test_graph_replay_pads_to_the_width_bucket_and_matches_eager(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    fake = FakeCapturer(runner.model, runner.cache)
    graphs = _decode_runner(runner, fake)
    graphs.capture_all()
    eager = _decode_runner(runner, None)

    tables = [blocks_for(10 * i, 24) for i in range(3)]
    firsts = [_prefill(runner, i, random_prompt(17, seed=i), tables[i]) for i in range(3)]
    before = [(kv.k.clone(), kv.v.clone()) for kv in runner.cache.layers]
    step = decode_inputs(runner, firsts, [17] * 3, tables)
    replayed = graphs.run(step).dense()  # 5 blocks: width bucket 8
    assert fake.replays == [(4, 8)]
    for layer, (k, v) in zip(runner.cache.layers, before, strict=True):
        layer.k.copy_(k)
        layer.v.copy_(v)
    expected = eager.run(step).dense()
    assert max_diff(replayed, expected) < 1e-4 * max(1.0, expected.abs().max().item())


def test_tables_wider_than_the_graph_context_run_eagerly(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    fake = FakeCapturer(runner.model, runner.cache)
    decode = _decode_runner(runner, fake, graph_context_tokens=8)  # widths 1 and 2
    decode.capture_all()
    assert decode.widths == [1, 2]
    table = blocks_for(0, 16)
    first = _prefill(runner, 0, random_prompt(9, seed=3), table)
    decode.run(decode_inputs(runner, [first], [9], [table]))  # 3 blocks
    decode.run(decode_inputs(runner, [first], [5], [table]))  # 2 blocks
    assert fake.replays == [(1, 2)]


def test_the_runner_captures_before_its_handshake(tiny_llama_dir, monkeypatch):
    made = []

    def fake_capturer(model, cache, use_cuda_graphs):
        made.append(FakeCapturer(model, cache, fail={(16, 64)}))
        return made[-1]

    monkeypatch.setattr(gpu_worker.runtime, "graph_capturer", fake_capturer)
    runner = make_runner(tiny_llama_dir)
    (fake,) = made
    graphs = runner.handshake.graphs
    assert len(fake.captures) == len(runner.decode_runner.shapes())
    assert graphs["captured"] == len(fake.captures) - 1 and graphs["failed"] == [[16, 64]]
    assert graphs["seconds"] >= 0


@pytest.mark.parametrize("use_cuda_graphs", [True, False])
def test_a_cpu_runner_captures_nothing(tiny_llama_dir, use_cuda_graphs):
    runner = make_runner(tiny_llama_dir, use_cuda_graphs=use_cuda_graphs)
    assert runner.decode_runner.capturer is None
    assert graph_capturer(runner.model, runner.cache, use_cuda_graphs) is None
    graphs = runner.handshake.graphs
    assert (graphs["captured"], graphs["failed"], graphs["widths"]) == (0, [], [])


def test_the_staged_step_equals_its_facts_padded_by_the_one_rule(tiny_llama_dir):
    """A decode step's staged integers, gathered tables and derived slots and contexts
    (what a replay computes) equal the general path's facts (StepInputs.tables, slots:
    what mixed steps use) padded by the one padding rule."""
    runner = make_runner(tiny_llama_dir)
    tables = [blocks_for(10 * i, 4 * i + 9) for i in range(3)]
    firsts = [_prefill(runner, i, random_prompt(4 * i + 9, seed=i), tables[i]) for i in range(3)]
    inputs = decode_inputs(runner, firsts, [4 * i + 9 for i in range(3)], tables)
    staging = runner.decode_runner.staging
    batch, width, scratch, bs = 8, 6, runner.cache.scratch_block, runner.cache.block_size
    ints = staging.send(staging.stage(inputs, batch))
    gathered = gather_tables(inputs.held_tables, ints[2], width)

    assert ints[0].tolist() == [*firsts, 0, 0, 0, 0, 0]
    assert ints[1].tolist() == [9, 13, 17, 0, 0, 0, 0, 0]
    padded_tables = torch.full((1, batch, width), scratch)
    padded_tables[:, :3, : inputs.tables.shape[2]] = inputs.tables
    assert torch.equal(gathered, padded_tables)
    padded_slots = torch.full((1, batch), scratch * bs)
    padded_slots[:, :3] = inputs.slots
    assert torch.equal(decode_slots(gathered, ints[1], bs), padded_slots)
    # No sequence holds the padding row: it names the scratch block alone.
    assert PAD_SLOT not in [seq.slot for seq in inputs.seqs]
    assert bool((runner.table.tables[:, PAD_SLOT] == scratch).all())
