"""The worker's KV connectors move a prompt's blocks between two caches: segments coalesce runs
of consecutive blocks, the copy lands in the right blocks of every tensor and head, the
producer is notified as the read begins and when it is done, a pull that cannot start before
the producer's hold ends fails unread, and a failed pull is reported, on the in-process
connector and on Mooncake's real transfer engine over loopback TCP. A prompt staged in the
producer's arena is read in one segment (or one per tensor and head, straight into a run of
blocks)."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from gpu_worker import kv_cache
from gpu_worker.kv_cache import KVCache, LayerKV
from gpu_worker.kv_connector import (
    NOTICE_DONE,
    NOTICE_READING,
    KvConnector,
    Notice,
    block_runs,
    make_connector,
)
from gpu_worker.kv_groups import KVGroups
from gpu_worker.kv_staging import allocate_arena
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import KV_ENGINE_LOCAL, KV_ENGINE_MOONCAKE, KvPull, KvStage, PullDone

HEADS, BLOCK, DIM = 3, 4, 8


def _cache(num_blocks: int, seed: int) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    shape = (HEADS, num_blocks + 1, BLOCK, DIM)
    slots = [
        LayerKV(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(2)
    ]
    return KVCache(slots=slots, layers=slots, num_blocks=num_blocks, block_size=BLOCK)


def _wait_done(connector: KvConnector) -> PullDone:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if done := connector.poll_done():
            return done[0]
        time.sleep(0.005)
    raise AssertionError("the pull never ended")


def test_block_runs_coalesce_blocks_consecutive_on_both_sides() -> None:
    runs = list(block_runs([4, 5, 6, 9, 10, 11], [0, 1, 3, 4, 5, 7]))
    assert runs == [(4, 0, 2), (6, 3, 1), (9, 4, 2), (11, 7, 1)]


@pytest.mark.parametrize("engine", [KV_ENGINE_LOCAL, KV_ENGINE_MOONCAKE])
def test_a_pull_copies_the_blocks_and_notifies_the_producer(engine: str) -> None:
    producer_cache, consumer_cache = _cache(12, 1), _cache(20, 2)
    producer = make_connector(engine, "127.0.0.1")
    consumer = make_connector(engine, "127.0.0.1")
    try:
        addresses = producer.register(producer_cache)
        consumer.register(consumer_cache)
        remote, local = [2, 3, 4, 7], [10, 11, 5, 6]
        untouched = consumer_cache.slots[0].k[:, 12].clone()
        pull = KvPull("t-1", producer.address, remote, local, addresses, 12)
        consumer.submit([pull])
        done = _wait_done(consumer)
        assert done.error is None
        # runs (10,2,2) (5,4,1) (6,7,1): three segments per head of each of 4 tensors
        assert done.segments == 3 * HEADS * 4
        assert done.bytes == len(remote) * HEADS * BLOCK * DIM * 4 * 4
        for mine, theirs in zip(consumer_cache.slots, producer_cache.slots, strict=True):
            for a, b in ((mine.k, theirs.k), (mine.v, theirs.v)):
                assert torch.equal(a[:, local], b[:, remote])
        assert torch.equal(consumer_cache.slots[0].k[:, 12], untouched)
        assert _notices(producer) == [("t-1", NOTICE_READING), ("t-1", NOTICE_DONE)]
        # a pull that waited past its start_within (the hold's end) fails without reading
        late = KvPull("t-late", producer.address, [8], [0], addresses, 12, start_within=0.0)
        before = consumer_cache.slots[0].k[:, 0].clone()
        consumer.submit([late])
        failed = _wait_done(consumer)
        assert "hold ends before" in (failed.error or "") and producer.poll_notices() == []
        assert torch.equal(consumer_cache.slots[0].k[:, 0], before)
        # a producer that is gone: the pull fails, it is reported, nothing hangs
        gone = KvPull(
            "t-2",
            "127.0.0.1:1" if engine == KV_ENGINE_MOONCAKE else "local:x",
            [0],
            [0],
            addresses,
            12,
        )
        consumer.submit([gone])
        failed = _wait_done(consumer)
        assert failed.transfer_id == "t-2" and failed.error
    finally:
        consumer.close()
        producer.close()


def _notices(producer: KvConnector) -> list[Notice]:
    """The producer's notices up to the first that says a read is done."""
    deadline, notices = time.monotonic() + 10, []
    while not any(kind == NOTICE_DONE for _, kind in notices) and time.monotonic() < deadline:
        notices += producer.poll_notices()
        time.sleep(0.005)
    return notices


@pytest.mark.parametrize("engine", [KV_ENGINE_LOCAL, KV_ENGINE_MOONCAKE])
def test_a_staged_prompt_is_read_whole_into_fragmented_or_consecutive_blocks(engine: str) -> None:
    producer_cache, consumer_cache = _cache(12, 1), _cache(20, 2)
    per_block = 4 * HEADS * BLOCK * DIM * 4  # 4 tensors of float32
    producer = make_connector(engine, "127.0.0.1")
    consumer = make_connector(engine, "127.0.0.1")
    try:
        arena = allocate_arena(8, per_block, torch.device("cpu"))
        addresses = producer.register(producer_cache, arena)
        consumer.register(consumer_cache)
        assert producer.staging_blocks == 8 and producer.staging_address == arena.data_ptr()
        remote = [9, 2, 7, 4]  # no two consecutive: unstaged, a segment per block
        producer.stage([KvStage(remote, 3), KvStage(remote[:2], 0)])
        for name, local, at, segments in (
            ("t-small", [1, 3], 0, 1),  # landed whole, then scattered
            ("t-run", [14, 15, 16, 17], 3, 4 * HEADS),  # straight in: per tensor and head
            ("t-frag", [11, 5, 18, 0], 3, 1),  # a larger region: the landing buffer grows
        ):
            pull = KvPull(name, producer.address, remote[: len(local)], local, addresses, 12)
            pull.remote_staging_address = arena.data_ptr() + at * per_block
            consumer.submit([pull])
            done = _wait_done(consumer)
            assert (done.error, done.segments) == (None, segments)
            assert done.bytes == len(local) * per_block
            for mine, theirs in zip(consumer_cache.slots, producer_cache.slots, strict=True):
                for a, b in ((mine.k, theirs.k), (mine.v, theirs.v)):
                    assert torch.equal(a[:, local], b[:, remote[: len(local)]])
            assert _notices(producer) == [(name, NOTICE_READING), (name, NOTICE_DONE)]
        with pytest.raises(ValueError, match="does not fit"):
            producer.stage([KvStage(remote, 5)])
    finally:
        consumer.close()
        producer.close()


def test_a_pull_whose_layout_differs_fails_without_copying() -> None:
    producer, consumer = make_connector(KV_ENGINE_LOCAL, ""), make_connector(KV_ENGINE_LOCAL, "")
    try:
        consumer.register(_cache(4, 2))
        consumer.submit([KvPull("t-3", producer.address, [0], [0], [1, 2, 3], 4)])
        done = consumer.poll_done()  # refused at once, before any thread
        assert [d.transfer_id for d in done] == ["t-3"] and "cache tensors" in (done[0].error or "")
    finally:
        consumer.close()
        producer.close()


def test_a_fragmented_pull_of_more_segments_than_mooncake_queues_succeeds() -> None:
    """A run per block (nothing consecutive) over every tensor and head: 2,200 segments of
    4 KiB, past the 2,048 tasks Mooncake's TCP transport takes in one batch."""
    blocks, heads, dim = 1100, 1, 64
    shape = (heads, 2 * blocks + 1, BLOCK, dim)
    caches = [
        KVCache(slots=[slot], layers=[slot], num_blocks=2 * blocks, block_size=BLOCK)
        for slot in (LayerKV(torch.randn(shape), torch.randn(shape)) for _ in range(2))
    ]
    producer = make_connector(KV_ENGINE_MOONCAKE, "127.0.0.1")
    consumer = make_connector(KV_ENGINE_MOONCAKE, "127.0.0.1")
    try:
        addresses = producer.register(caches[0])
        consumer.register(caches[1])
        remote, local = list(range(0, 2 * blocks, 2)), list(range(1, 2 * blocks, 2))
        consumer.submit([KvPull("t-4", producer.address, remote, local, addresses, 2 * blocks)])
        done = _wait_done(consumer)
        assert done.error is None and done.segments == 2 * blocks * heads
        for mine, theirs in zip(caches[1].slots, caches[0].slots, strict=True):
            assert torch.equal(mine.k[:, local], theirs.k[:, remote])
            assert torch.equal(mine.v[:, local], theirs.v[:, remote])
        # once as it begins, once after the last batch
        assert _notices(producer) == [("t-4", NOTICE_READING), ("t-4", NOTICE_DONE)]
    finally:
        consumer.close()
        producer.close()


def test_a_pull_of_every_kv_group_lands_in_each_groups_layers() -> None:
    """Gemma 3 270M's layout (a full group and five windowed ones of 3 layers, in 3 slots):
    a block id names the same place in every cache tensor, whichever group holds it, so a
    pull that lists every group's (remote, local) pairs in one pair of lists moves each
    group's K/V into the slots its layers read."""
    raw = transformers.Gemma3TextConfig(
        num_hidden_layers=18, sliding_window=512, num_key_value_heads=1, head_dim=8
    ).to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["Gemma3ForCausalLM"]})
    groups = KVGroups.of(config)
    assert groups.num_groups == 6 and groups.num_slots == 3
    caches = [
        kv_cache.allocate(config, n, BLOCK, torch.float32, torch.device("cpu")) for n in (12, 20)
    ]
    for tensor in (t for slot in caches[0].slots for t in slot.tensors if t is not None):
        tensor.copy_(torch.randn(tensor.shape))
    remote = [[2 * g, 2 * g + 1] for g in range(groups.num_groups)]  # one pool, two each
    local = [[19 - g, 6 + g] for g in range(groups.num_groups)]
    producer = make_connector(KV_ENGINE_LOCAL, "")
    consumer = make_connector(KV_ENGINE_LOCAL, "")
    try:
        addresses = producer.register(caches[0])
        consumer.register(caches[1])
        flat = [[b for ids in lists for b in ids] for lists in (remote, local)]
        consumer.submit([KvPull("t-5", producer.address, *flat, addresses, 12)])
        done = _wait_done(consumer)
    finally:
        consumer.close()
        producer.close()
    assert done.error is None
    assert done.bytes == 12 * kv_cache.block_bytes(config, BLOCK, torch.float32)
    for g, layers in enumerate(groups.layers):
        for layer in layers:
            mine, theirs = caches[1].layers[layer], caches[0].layers[layer]
            assert torch.equal(mine.k[:, local[g]], theirs.k[:, remote[g]])
            assert torch.equal(mine.v[:, local[g]], theirs.v[:, remote[g]])
