"""Mixed steps from graphs (gpu_worker.mixed_graphs), with a fake capturer that replays each
captured function eagerly: the static buffers, the padding to a token bucket, and either
the eager attention between pieces or (whole steps, through TritonAttention run by Triton's
interpreter) the step's records refilled each step, must give the model's own forward
pass, bit for bit, and leave the same K/V for later steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_worker.buckets import smallest_fitting
from gpu_worker.mixed_graphs import MixedGraphs, static_records, token_buckets
from gpu_worker.protocol import StepPlan
from gpu_worker.runner import ModelRunner
from tests.triton_interpreter import run_interpreted
from tests.worker_fixtures import (
    Chunk,
    blocks_for,
    make_plan,
    make_runner,
    random_prompt,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Replay:
    def __init__(self, piece) -> None:
        self.piece = piece
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.piece()


class FakeCapturer:
    def __init__(self) -> None:
        self.captured: list[Replay] = []
        self.pools: list[object] = []

    def new_pool(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, piece, pool) -> Replay:
        assert pool is self.pools[-1]
        self.captured.append(Replay(piece))
        return self.captured[-1]


def test_token_buckets_step_by_64_to_1024_then_by_128_to_the_step_budget():
    assert token_buckets(512) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    buckets = token_buckets(2048)
    assert buckets[-10:] == [960, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]
    # a 512-token chunk beside 64 decode rows pays for no padding
    assert smallest_fitting(576, buckets) == 576
    # at most 63 padded tokens to 1,024, 127 beyond
    for tokens in range(33, 2049):
        padded = smallest_fitting(tokens, buckets) - tokens
        assert padded < (64 if tokens <= 1024 else 128)


def steps() -> list[list[Chunk]]:
    first, second = random_prompt(30, seed=1), random_prompt(50, seed=2)
    return [
        [Chunk(0, first[:20], 0, blocks_for(0, 31))],  # 20 tokens: bucket 32
        [  # a chunk beside decode rows: 10 + 1 + 1 tokens, bucket 16
            Chunk(0, first[20:], 20, blocks_for(0, 31)),
            Chunk(1, [7], 0, blocks_for(10, 52)),
            Chunk(2, [9], 0, blocks_for(30, 2)),
        ],
        [Chunk(1, second, 1, blocks_for(10, 52)), Chunk(0, [4], 30, blocks_for(0, 31))],
        [Chunk(3, random_prompt(70, seed=3), 0, blocks_for(40, 70))],  # past 64: eager
        [Chunk(i, [5], start, blocks_for(b, 52)) for i, start, b in [(0, 31, 0), (1, 51, 10)]],
    ]


def test_piecewise_mixed_steps_equal_the_eager_forward_bit_for_bit(tiny_llama_dir):
    eager = make_runner(tiny_llama_dir, max_num_batched_tokens=64)
    graphed = make_runner(tiny_llama_dir, max_num_batched_tokens=64)
    fake = FakeCapturer()
    graphed.mixed = MixedGraphs(graphed.model, graphed.cache, 64, fake)
    report = graphed.mixed.capture_all()
    assert report["buckets"] == [16, 32, 64] and report["failed"] == []
    # Each bucket: a piece before the first attention, one between each two, one after.
    assert len(fake.captured) == 3 * (graphed.model.config.num_hidden_layers + 1)
    for seqs in steps():
        want = eager.step_logits(make_plan(seqs))
        got = graphed.step_logits(make_plan(seqs))
        assert torch.equal(got, want)
    # Every bucket's buffers are the first rows of the largest's: one set of memory.
    buffers = graphed.mixed._buffers
    storages = {buffers[b].x.untyped_storage().data_ptr() for b in (16, 32, 64)}
    assert len(storages) == 1
    # Every bucket served a step (the first pieces of 64, 32 and 16 replayed).
    layers = graphed.model.config.num_hidden_layers + 1
    assert [fake.captured[i * layers].replays for i in range(3)] == [1, 1, 1]


def triton_runner(model_dir) -> ModelRunner:
    """A CPU runner whose attention is TritonAttention (offered on CUDA alone)."""
    from gpu_worker.attention.triton_backend import TritonAttention

    runner = make_runner(model_dir, max_num_batched_tokens=64)
    runner.model.kernels = dataclasses.replace(runner.model.kernels, attention=TritonAttention())
    return runner


def interpret(model_dir: str, path: str) -> None:
    """In the subprocess, under Triton's interpreter: each step's logits from an eager runner
    and from one whose mixed steps are captured whole, and the capture's bookkeeping."""
    eager, graphed = triton_runner(model_dir), triton_runner(model_dir)
    model, cache = graphed.model, graphed.cache
    records = static_records(model, cache, 64, 16, graphed.table.tables.shape[2])
    fake = FakeCapturer()
    graphed.mixed = MixedGraphs(model, cache, 64, fake, records)
    report = graphed.mixed.capture_all()
    groups = graphed.limits.num_groups

    def plan(seqs: list[Chunk]) -> StepPlan:
        return make_plan(seqs, num_groups=groups)

    pairs = [(eager.step_logits(plan(seqs)), graphed.step_logits(plan(seqs))) for seqs in steps()]
    replays = [replay.replays for replay in fake.captured]
    torch.save({"report": report, "pairs": pairs, "replays": replays, "groups": groups}, path)


def test_whole_mixed_steps_equal_the_eager_forward_bit_for_bit(tiny_models, tmp_path):
    # Gemma 3: sliding and full layers in KV groups of their own, each with its records
    run_interpreted(__name__, str(tiny_models("gemma3")), str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["report"]["buckets"] == [16, 32, 64] and out["report"]["whole"]
    assert out["groups"] > 1
    for want, got in out["pairs"]:
        assert torch.equal(got, want)
    # One graph a bucket, captured largest first; each served a step (64, 32, 16).
    assert out["replays"] == [1, 1, 1]
