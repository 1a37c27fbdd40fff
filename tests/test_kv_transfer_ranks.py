"""P/D between tensor-parallel groups, piece by piece (the real pair of servers:
tests/test_api_pd_tensor_parallel.py): rank 0 reports a pull done only once every rank's
part is, failed if any part failed, and a hold released only once every rank has the
consumer's notice, however the ranks' news falls across steps; a pull's part for rank r
reads producer rank r; the producer's answer lists its ranks and the consumer reads and
checks them; the scheduler asks for the ranks' news only while transfers are pending."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from gpu_worker.kv_connector import make_connector
from gpu_worker.kv_ranks import GroupTransfers, RankNews
from gpu_worker.protocol import (
    KV_ENGINE_LOCAL,
    Handshake,
    KvPull,
    PullDone,
    RemoteRank,
    StepPlan,
    StepResult,
    step_plan_from_message,
    to_message,
)
from service.api.errors import APIError
from service.api.kv_transfer_params import kv_transfer_fields
from service.engine.kv_transfer import Fingerprint, KvHold, check_kv_transfer, producer_params
from service.engine.request import SamplingParams
from service.engine.validation import InvalidRequest
from tests.scheduler_helpers import make_request, make_scheduler

WORLD = 3


def test_a_pull_is_done_once_every_ranks_part_is_with_their_bytes_summed() -> None:
    tally = GroupTransfers(WORLD)
    part = PullDone("t", bytes=10, segments=2)
    first = tally.combine([RankNews([part]), RankNews(), RankNews([part])])
    assert first.done == []  # rank 1 may still write its blocks
    assert tally.combine([RankNews(), RankNews([part]), RankNews()]).done == [
        PullDone("t", None, 30, 6)
    ]
    assert tally.combine([RankNews([part]), RankNews(), RankNews()]).done == []  # a new count


def test_a_pull_failed_on_one_rank_fails_once_every_part_has_ended() -> None:
    tally = GroupTransfers(WORLD)
    failed = PullDone("t", error="refused")
    assert tally.combine([RankNews(), RankNews([failed]), RankNews()]).done == []
    done = tally.combine(
        [RankNews([PullDone("t", bytes=4)]), RankNews(), RankNews([PullDone("t")])]
    )
    assert [d.error for d in done.done] == ["rank 1: refused"]


def test_a_hold_is_released_once_every_rank_has_the_notice() -> None:
    tally = GroupTransfers(WORLD)
    assert (
        tally.combine([RankNews(notices=["a", "b"]), RankNews(notices=["a"]), RankNews()]).notices
        == []
    )
    released = tally.combine([RankNews(), RankNews(notices=["b"]), RankNews(notices=["a", "b"])])
    assert released.notices == ["a", "b"]


def test_a_forgotten_holds_notices_are_dropped_then_and_later() -> None:
    """A consumer that died after two of three ranks read: the service's hold expires and
    the plan says so; rank 0 keeps no count of it, nor of the third rank's late notice."""
    tally = GroupTransfers(WORLD)
    tally.combine([RankNews(notices=["a"]), RankNews(notices=["a", "b"]), RankNews()])
    tally.forget(["a"])
    assert dict(tally._noticed) == {"b": 1}
    late = tally.combine([RankNews(notices=["b"]), RankNews(), RankNews(notices=["a", "b"])])
    assert late.notices == ["b"] and not tally._noticed
    plan = StepPlan(1, [], [], forgotten=["a"])
    received = step_plan_from_message(orjson.loads(orjson.dumps(to_message("step", plan))))
    assert received.forgotten == ["a"]


def test_each_rank_pulls_its_shard_from_the_same_producer_rank() -> None:
    ranks = [RemoteRank(f"h:{port}", [port * 100, port * 100 + 1]) for port in (1, 2, 3)]
    pull = KvPull("t", "h:1", [4, 5], [7, 8], [100, 101], 9, ranks=ranks)
    plan = StepPlan(1, [], [], pulls=[pull], transfer_news=True)
    message = orjson.loads(orjson.dumps(to_message("step", plan)))  # as the wire carries it
    received = step_plan_from_message(message)
    assert received.transfer_news and received.pulls == [pull]
    mine = received.pulls[0].for_rank(2)
    assert (mine.peer, mine.remote_tensors, mine.ranks) == ("h:3", [300, 301], [])
    assert (mine.remote_blocks, mine.local_blocks) == ([4, 5], [7, 8])
    one_rank = dataclasses.replace(pull, ranks=[])
    assert one_rank.for_rank(0) is one_rank


def test_a_pull_that_lists_no_producer_rank_for_this_one_fails_as_a_pull() -> None:
    consumer = make_connector(KV_ENGINE_LOCAL, "")
    try:
        pull = KvPull("t", "local:x", [0], [0], [1], 4, ranks=[RemoteRank("local:x", [1])])
        consumer.submit([pull], rank=1)
        done = consumer.poll_done()  # refused at once, the step goes on
        assert [d.transfer_id for d in done] == ["t"] and "rank 1" in (done[0].error or "")
    finally:
        consumer.close()


def handshake(ranks: int) -> Handshake:
    entries = [
        {
            "rank": r,
            "kv_transfer_address": f"10.0.0.1:{7000 + r}",
            "kv_tensor_addresses": [r, 9],
            "kv_staging_address": ARENA * (r + 1),
        }
        for r in range(ranks)
    ]
    return Handshake(
        "m", "LlamaForCausalLM", 10, 64, 1, 3, 4, "float32", "cpu", 4, 16, 0, "float32",
        [1], 0, 0.0, ranks=entries, kv_transfer_address="10.0.0.1:7000",
        kv_tensor_addresses=[0, 9], kv_block_bytes=BLOCK_BYTES, kv_staging_address=ARENA,
    )  # fmt: skip


ARENA, BLOCK_BYTES = 1 << 20, 256  # rank r's arena at ARENA x (r + 1)


def answer(
    ranks: int, transfer_id: str = "t", prompt_tokens: int = 6, staged_at: int | None = None
) -> dict:
    """A producer's kv_transfer_params at tensor parallel size `ranks`."""
    producer = handshake(ranks)
    blocks = list(range(1, 1 + -(-prompt_tokens // producer.block_size)))
    hold = KvHold(transfer_id, 0, blocks, prompt_tokens, 30.0, staged_at)
    return producer_params(hold, producer, "e", Fingerprint.of(producer), now=0.0)


def test_the_producer_lists_its_ranks_and_the_consumer_reads_and_counts_them() -> None:
    params = answer(WORLD)
    assert params["remote_port"] == 7000 and params["remote_tensors"] == [0, 9]
    assert params["remote_ranks"][2] == {
        "remote_host": "10.0.0.1", "remote_port": 7002, "remote_tensors": [2, 9],
        "remote_staging_address": None,
    }  # fmt: skip
    remote = kv_transfer_fields(params)["remote_kv"]
    assert remote.ranks[2] == RemoteRank("10.0.0.1:7002", [2, 9])
    # staged: each rank's shard at the same offset of its own arena
    staged = kv_transfer_fields(answer(WORLD, staged_at=5))["remote_kv"]
    offset = 5 * BLOCK_BYTES
    assert staged.staging_address == ARENA + offset
    assert [r.staging_address for r in staged.ranks] == [ARENA * (r + 1) + offset for r in range(3)]
    assert staged.ranks[1] == RemoteRank("10.0.0.1:7001", [1, 9], 2 * ARENA + offset)
    consumer = handshake(WORLD)
    check_kv_transfer(SamplingParams(remote_kv=remote), 6, 1, "consumer", consumer)
    short = dataclasses.replace(remote, ranks=remote.ranks[:2])
    with pytest.raises(InvalidRequest, match="remote_ranks"):
        check_kv_transfer(SamplingParams(remote_kv=short), 6, 1, "consumer", consumer)
    assert "remote_ranks" not in answer(1)


@pytest.mark.parametrize(
    "ranks", [{"remote_host": "h"}, [{"remote_host": "h", "remote_port": "1"}], [7]]
)
def test_malformed_remote_ranks_are_a_400_naming_them(ranks: object) -> None:
    with pytest.raises(APIError, match="remote_ranks") as raised:
        kv_transfer_fields({**answer(1), "remote_ranks": ranks})
    assert raised.value.status == 400


def test_the_scheduler_asks_for_the_ranks_news_only_while_transfers_are_pending() -> None:
    sched, _ = make_scheduler(num_blocks=8)
    request = make_request(0, 6)
    remote = kv_transfer_fields(answer(1, "t0"))["remote_kv"]
    request.params = dataclasses.replace(request.params, remote_kv=remote)
    sched.add(request)
    out = sched.schedule(0.0)
    assert out.plan is not None and out.plan.pulls and out.plan.transfer_news
    sched.update(out, StepResult(out.iteration, pulls_done=[PullDone("t0")]))
    out = sched.schedule(0.0)  # it computes the prompt's last token: nothing on the move
    assert out.plan is not None and out.plan.rows and not out.plan.transfer_news
