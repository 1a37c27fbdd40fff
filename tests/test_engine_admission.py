"""Deadlines and load shedding on the simulated worker (exact, instant time: MockClock).

A request may wait to start only so long (its `deadline_s`, the server's max_queue_time);
not started by then it ends once with ("error", "deadline_exceeded") and never reaches the
worker. At arrival the engine refuses, with a retry hint, what the queue cannot take: too
many prompt tokens waiting, a predicted TTFT over max_predicted_ttft, or a start predicted
after the request's deadline.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import trio

from service.engine.admission import Overloaded
from service.engine.engine import Engine
from service.engine.kv_transfer import Fingerprint, RemoteKv
from tests.sim_worker import (
    Collected,
    RecordingObserver,
    SimWorker,
    collect,
    greedy,
    running_engine,
    sim_config,
)


async def occupy(engine: Engine, nursery: trio.Nursery, tokens: int, name: str = "busy") -> None:
    """A running request that holds the only sequence slot for `tokens` decode steps."""
    channel = await engine.submit([5] * 16, greedy(tokens), request_id=name)
    nursery.start_soon(collect, channel)
    while engine.state()["running"] == 0:
        await trio.sleep(0.001)


async def test_a_request_not_started_by_its_deadline_ends_once_and_never_runs(autojump_clock):
    worker = SimWorker()
    observer = RecordingObserver()
    async with running_engine(sim_config(max_num_seqs=1), worker) as engine:
        engine.add_observer(observer)
        async with trio.open_nursery() as nursery:
            await occupy(engine, nursery, 200)  # ~1.1 s of steps
            submitted = trio.current_time()
            late = await engine.submit([7] * 8, greedy(4), request_id="late", deadline_s=0.25)
            out = await collect(late)
            waited = trio.current_time() - submitted
    assert out.tokens == []
    assert out.finish is not None
    assert (out.finish.reason, out.finish.detail) == ("error", "deadline_exceeded")
    assert "0.25 s deadline" in (out.finish.error or "")
    assert 0.25 <= waited <= 0.25 + 0.01  # ended at the first step boundary after it
    assert [s.request_id for s in observer.finished].count("late") == 1
    assert observer.refused == ["deadline_exceeded"]
    late_seq = 1
    assert all(late_seq not in plan.seq_ids for plan in worker.plans)
    assert engine.state()["waiting"] == 0


async def test_a_deadline_met_is_forgotten_once_the_request_has_started(autojump_clock):
    async with running_engine(sim_config(), SimWorker()) as engine:
        channel = await engine.submit([7] * 8, greedy(300), request_id="r", deadline_s=0.05)
        out = await collect(channel)
    assert out.finish is not None and out.finish.reason == "length"
    assert len(out.tokens) == 300  # ran ~1.6 s, long past its 50 ms deadline to start


async def test_the_servers_max_queue_time_bounds_every_request_and_the_tighter_one_wins(
    autojump_clock,
):
    config = sim_config(max_num_seqs=1, max_queue_time=0.5)
    async with running_engine(config, SimWorker()) as engine, trio.open_nursery() as nursery:
        await occupy(engine, nursery, 400)
        results: dict[str, tuple[Collected, float]] = {}

        async def wait(name: str, deadline_s: float | None) -> None:
            start = trio.current_time()
            channel = await engine.submit(
                [7] * 8, greedy(4), request_id=name, deadline_s=deadline_s
            )
            results[name] = (await collect(channel), trio.current_time() - start)

        nursery.start_soon(wait, "server", None)
        nursery.start_soon(wait, "own", 0.2)
        nursery.start_soon(wait, "looser", 5.0)
    for name, limit in (("server", 0.5), ("own", 0.2), ("looser", 0.5)):
        out, waited = results[name]
        assert out.finish is not None and out.finish.detail == "deadline_exceeded", name
        assert limit <= waited <= limit + 0.01, name


async def test_the_queue_is_bounded_by_waiting_prompt_tokens(autojump_clock):
    worker = SimWorker(max_model_len=512)
    config = sim_config(max_num_seqs=1, max_queued_tokens=600)
    observer = RecordingObserver()
    async with running_engine(config, worker) as engine:
        engine.add_observer(observer)
        async with trio.open_nursery() as nursery:
            await occupy(engine, nursery, 100)
            accepted = []
            for i in range(3):
                channel = await engine.submit([7] * 200, greedy(2), request_id=f"q{i}")
                accepted.append(channel)
                nursery.start_soon(collect, channel)
            assert engine.state()["waiting"] == 3
            with pytest.raises(Overloaded, match="600 prompt tokens are waiting"):
                await engine.submit([7] * 10, greedy(2), request_id="over")
            assert engine.state()["waiting"] == 3  # nothing queued by the refusal
            assert observer.refused == ["queued_tokens"]
        after = await engine.submit([7] * 200, greedy(2), request_id="after")
        out = await collect(after)
    assert out.finish is not None and out.finish.reason == "length"


async def test_the_token_bound_never_refuses_one_full_window_prompt(autojump_clock):
    worker = SimWorker(max_model_len=512)
    async with running_engine(sim_config(max_queued_tokens=1), worker) as engine:
        out = await collect(await engine.submit([7] * 500, greedy(4), request_id="whole"))
    assert out.finish is not None and out.finish.reason == "length"


async def warm_cost_model(engine: Engine) -> None:
    """Enough measured steps, with chunks of several sizes, for the step-cost model to
    tell a chunk's tokens from its overhead."""
    for i, length in enumerate((40, 120, 250)):
        await collect(await engine.submit([3] * length, greedy(4), request_id=f"warm{i}"))
    assert engine.state()["step_cost"] is not None


async def test_a_request_whose_predicted_ttft_exceeds_the_target_is_refused_at_arrival(
    autojump_clock,
):
    worker = SimWorker(base_ms=5.0, per_token_ms=1.0, per_seq_ms=0.0)  # 1 ms a prompt token
    config = sim_config(max_predicted_ttft=1.0, max_batched_tokens=256)
    async with running_engine(config, worker) as engine:
        await warm_cost_model(engine)
        results: dict[str, Collected] = {}
        refused: list[Overloaded] = []
        arrived = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def read(name: str, channel: trio.MemoryReceiveChannel) -> None:
                results[name] = await collect(channel)

            for i in range(8):  # 8 x 300 tokens ~ 2.4 s of prefill: the later ones would wait
                try:
                    channel = await engine.submit([9 + i] * 300, greedy(2), request_id=f"p{i}")
                except Overloaded as exc:
                    refused.append(exc)
                    continue
                nursery.start_soon(read, f"p{i}", channel)
            decided = trio.current_time() - arrived
    assert decided < 0.001  # refused within the arrival, not after waiting
    assert 2 <= len(refused) <= 6
    assert all(exc.retry_after > 0 and "exceeds the server's 1 s" in str(exc) for exc in refused)
    for name, out in results.items():
        assert out.times[0] - arrived <= 1.0 * 1.1, name  # the admitted still meet it


async def test_a_request_that_cannot_start_before_its_deadline_is_refused_at_arrival(
    autojump_clock,
):
    worker = SimWorker(base_ms=5.0, per_token_ms=1.0, per_seq_ms=0.0)
    async with running_engine(sim_config(max_batched_tokens=256), worker) as engine:
        await warm_cost_model(engine)
        async with trio.open_nursery() as nursery:
            for i in range(4):  # ~1.2 s of prefill ahead
                channel = await engine.submit([9 + i] * 300, greedy(2), request_id=f"p{i}")
                nursery.start_soon(collect, channel)
            with pytest.raises(Overloaded, match="after its deadline") as refused:
                await engine.submit([1] * 10, greedy(2), request_id="hurry", deadline_s=0.2)
            assert refused.value.retry_after > 0.5
            patient = await engine.submit([1] * 10, greedy(2), request_id="ok", deadline_s=5.0)
            out = await collect(patient)
    assert out.finish is not None and out.finish.reason == "length"


async def test_a_tenant_gets_its_share_of_the_queue_and_another_is_still_admitted(
    autojump_clock,
):
    """--tenant-quota 0.5 of an 8-sequence queue: tenant a may have 4 sequences waiting
    (sub-tenants count as a), its fifth is refused, tenant b's requests are admitted."""
    config = sim_config(max_num_seqs=1, max_queue=8, tenant_quota=0.5)
    observer = RecordingObserver()
    async with running_engine(config) as engine:
        engine.add_observer(observer)
        async with trio.open_nursery() as nursery:
            await occupy(engine, nursery, 100)
            for i, tenant in enumerate(["a", "a/x", "a/y", "a"]):
                channel = await engine.submit([7] * 8, greedy(2), request_id=f"a{i}", tenant=tenant)
                nursery.start_soon(collect, channel)
            with pytest.raises(Overloaded, match="tenant 'a' would have 5 sequences waiting"):
                await engine.submit([7] * 8, greedy(2), request_id="a-over", tenant="a/z")
            with pytest.raises(Overloaded, match="tenant 'a'"):  # n counts each sequence
                await engine.submit([7] * 8, greedy(2), request_id="b-n", tenant="a", n=2)
            for i in range(3):
                channel = await engine.submit([7] * 8, greedy(2), request_id=f"b{i}", tenant="b")
                nursery.start_soon(collect, channel)
            assert engine.state()["waiting"] == 7
            assert engine.tenant_load()["a"].waiting == 4
            assert observer.refused == ["tenant_queue_full", "tenant_queue_full"]


async def test_a_tenants_flood_of_n_sequences_leaves_another_tenant_a_running_slot(
    autojump_clock,
):
    """--tenant-quota 0.5 of 4 slots: tenant a's two n=4 requests fill every slot (no one
    else waits) and keep 4 sequences waiting; tenant b's request runs and finishes within a
    few steps, while a's 100-token sequences are still generating."""
    config = sim_config(max_num_seqs=4, tenant_quota=0.5)
    async with running_engine(config) as engine, trio.open_nursery() as nursery:
        for i in range(2):
            channel = await engine.submit([7] * 8, greedy(100), request_id=f"a{i}", tenant="a", n=4)
            nursery.start_soon(collect_all, channel)
        while engine.state()["running"] < 4:
            await trio.sleep(0.001)
        assert engine.state()["waiting"] == 4
        submitted = engine.state()["iteration"]
        out = await collect(await engine.submit([7] * 8, greedy(2), request_id="b", tenant="b"))
        state = engine.state()
    assert out.finish is not None and out.finish.reason == "length"
    assert state["iteration"] - submitted <= 6
    assert state["running"] == 4 and state["corrections"]["tenant_slots_preempted"] == 1


def handed_over(engine: Engine, prompt_len: int, transfer_id: str):
    """A consumer's request whose K/V a producer holds (its pull never ends: the simulated
    worker moves no K/V)."""
    assert engine.handshake is not None
    blocks = -(-prompt_len // engine.handshake.block_size)
    fingerprint = asdict(Fingerprint.of(engine.handshake))
    remote = RemoteKv(
        transfer_id, "e", "127.0.0.1", 1, [[0] * blocks], [], 9, prompt_len, fingerprint
    )
    return greedy(4, remote_kv=remote)


async def test_a_consumers_requests_waiting_for_blocks_to_pull_into_fill_its_queue(
    autojump_clock,
):
    """A consumer whose cache is taken by one pull: the next two wait for blocks, and with
    --max-queue 2 the queue is full for the next one, handed over or not (429)."""
    config = sim_config(kv_transfer_role="consumer", max_queue=2, kv_transfer_timeout=600)
    async with running_engine(config, SimWorker(num_blocks=8)) as engine:
        prompt = [7] * 100  # 7 of the 8 blocks
        for i in range(3):
            await engine.submit(prompt, handed_over(engine, 100, f"t{i}"), request_id=f"r{i}")
        while engine.state()["kv_transfer"]["pulls"] != {"waiting": 2, "pulling": 1}:
            await trio.sleep(0.01)
        with pytest.raises(Overloaded, match="2 sequences are waiting") as refused:
            await engine.submit(prompt, handed_over(engine, 100, "t3"), request_id="r3")
        assert refused.value.reason == "queue_full"
        with pytest.raises(Overloaded, match="2 sequences are waiting"):
            await engine.submit([7] * 8, greedy(2), request_id="local")


async def test_a_consumers_request_waiting_for_blocks_ends_at_its_deadline(autojump_clock):
    """--max-queue-time bounds a wait for blocks to pull into as any wait to start."""
    config = sim_config(kv_transfer_role="consumer", max_queue_time=0.5, kv_transfer_timeout=5)
    async with running_engine(config, SimWorker(num_blocks=8)) as engine:
        prompt = [7] * 100  # 7 of the 8 blocks: the first pull takes them, for good
        await engine.submit(prompt, handed_over(engine, 100, "t0"), request_id="pulls")
        submitted = trio.current_time()
        waits = await engine.submit(prompt, handed_over(engine, 100, "t1"), request_id="waits")
        with trio.fail_after(1):  # long before the first pull's timeout frees its blocks
            out = await collect(waits)
        assert out.finish is not None and out.finish.detail == "deadline_exceeded"
        assert 0.5 <= trio.current_time() - submitted <= 0.51
        assert engine.state()["kv_transfer"]["pulls"] == {"waiting": 0, "pulling": 1}


async def collect_all(channel: trio.MemoryReceiveChannel) -> None:
    async for _ in channel:
        pass
