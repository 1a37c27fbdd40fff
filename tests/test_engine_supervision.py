"""The engine watches its worker: death or a hang while idle or mid-step is noticed and the
worker replaced; restarts are bounded; a smaller KV cache after a restart fails only what no
longer fits; iteration log lines can be sampled. (The same on real processes:
test_server_supervision.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import trio
from structlog.testing import capture_logs

from service.api.app import create_app
from service.engine.engine import EngineFailed, EngineUnavailable
from tests.sim_worker import (
    SimTokenizer,
    SimWorker,
    collect,
    expected_tokens,
    greedy,
    running_engine,
    sim_config,
)


async def wait_until(condition, timeout: float = 60.0) -> float:
    """Virtual seconds until `condition()` holds."""
    started = trio.current_time()
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)
    return trio.current_time() - started


async def test_a_worker_that_exits_while_idle_is_replaced_at_once(autojump_clock):
    worker = SimWorker()
    async with running_engine(worker=worker) as engine:
        await wait_until(lambda: engine.ready)
        worker.exit_while_idle()
        noticed = await wait_until(lambda: not engine.ready)
        assert noticed < 0.05  # the channel closing is seen at once, not at the next ping
        await wait_until(lambda: engine.ready)
        assert worker.starts == 2 and worker.kills == 1
        channel = await engine.submit([1, 2], greedy(3), request_id="after")
        assert (await collect(channel)).token_ids == expected_tokens([1, 2], 3)


async def test_a_worker_that_hangs_while_idle_is_killed_and_replaced(autojump_clock):
    worker = SimWorker()
    config = sim_config(step_timeout=5.0)
    async with running_engine(config, worker) as engine:
        await wait_until(lambda: engine.ready)
        worker.hung = True
        noticed = await wait_until(lambda: not engine.ready)
        # a ping goes out within a second of idling and gets step_timeout to answer
        assert 5.0 <= noticed <= 6.5
        await wait_until(lambda: engine.ready)
        assert worker.kills == 1 and worker.starts == 2


async def test_a_step_that_never_returns_fails_the_running_and_restarts(autojump_clock):
    worker = SimWorker(hang_at_step=3)
    config = sim_config(step_timeout=4.0, max_num_seqs=1)
    async with running_engine(config, worker) as engine:
        stuck = await engine.submit([1, 2, 3], greedy(20), request_id="stuck")
        queued = await engine.submit([4, 5], greedy(4), request_id="queued")
        with trio.fail_after(60):  # virtual seconds: a hang fails instead of stalling
            failed = await collect(stuck)
            served = await collect(queued)
    assert (failed.finish.reason, failed.finish.detail) == ("error", "worker_hung")
    assert failed.finish.error == "the worker stopped answering"
    assert served.token_ids == expected_tokens([4, 5], 4)
    assert worker.kills == 1 and worker.starts == 2


async def test_restarts_are_bounded_then_the_waiting_fail_and_the_engine_stops(autojump_clock):
    worker = SimWorker(die_at_step=2, failing_starts=100)
    config = sim_config(max_num_seqs=1, max_worker_restarts=3)
    outcomes = {}
    async with running_engine(config, worker) as engine:
        running = await engine.submit([1, 2], greedy(10), request_id="running")
        waiting = await engine.submit([3, 4], greedy(10), request_id="waiting")
        with trio.fail_after(600):
            outcomes["running"] = await collect(running)
            outcomes["waiting"] = await collect(waiting)
            await engine.wait_stopped()
        assert isinstance(engine.failure, EngineFailed) and not engine.ready
        with pytest.raises(EngineUnavailable):
            await engine.submit([5], greedy(1), request_id="after")
    assert outcomes["running"].finish.detail == "worker_died"
    assert (outcomes["waiting"].finish.reason, outcomes["waiting"].finish.detail) == (
        "error",
        "worker_unavailable",
    )
    assert worker._start_calls == 1 + 3


async def served_behind_a_crash(worker: SimWorker) -> list[int]:
    """A request waits behind one running when the worker dies; what it gets in the end."""
    config = sim_config(max_num_seqs=1, max_worker_restarts=3)
    async with running_engine(config, worker) as engine:
        await engine.submit([1, 2], greedy(10), request_id="running")
        waiting = await engine.submit([3, 4], greedy(5), request_id="waiting")
        with trio.fail_after(3600):  # virtual seconds: a hang fails instead of stalling
            return (await collect(waiting)).token_ids


async def test_a_restart_within_the_bound_keeps_the_waiting(autojump_clock):
    worker = SimWorker(die_at_step=2, failing_starts=2)
    assert await served_behind_a_crash(worker) == expected_tokens([3, 4], 5)
    assert worker.starts == 2


async def test_a_smaller_cache_after_a_restart_fails_only_what_no_longer_fits(autojump_clock):
    # 64 blocks of 16 tokens before the crash, 8 blocks after: 128 tokens minus the watermark
    worker = SimWorker(num_blocks=64, die_at_step=2, blocks_after_restart=8)
    config = sim_config(max_num_seqs=1)
    async with running_engine(config, worker) as engine:
        await engine.submit([1, 2], greedy(10), request_id="running")
        too_big = await engine.submit([5] * 100, greedy(400), request_id="too_big")
        fits = await engine.submit([6] * 10, greedy(20), request_id="fits")
        with trio.fail_after(60):
            refused = await collect(too_big)
            served = await collect(fits)
        assert engine.scheduler.capacity_tokens < 500
    assert (refused.finish.reason, refused.finish.detail) == ("error", "kv_capacity_exceeded")
    assert "500" in refused.finish.error
    assert served.token_ids == expected_tokens([6] * 10, 20)


@pytest.mark.parametrize(("every", "logged"), [(1, 12), (4, 3), (0, 0)])
async def test_iteration_lines_are_sampled(autojump_clock, every: int, logged: int):
    observed = []

    class Count:
        def on_iteration(self, stats) -> None:
            observed.append(stats.iteration)

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    with capture_logs() as logs:
        async with running_engine(sim_config(log_iterations=every)) as engine:
            engine.add_observer(Count())
            channel = await engine.submit([1, 2, 3], greedy(12), request_id="r")
            await collect(channel)
    lines = [event["iteration"] for event in logs if event["event"] == "iteration"]
    assert len(observed) == 12  # observers (metrics) always see every iteration
    assert lines == [i for i in observed if every and i % every == 0]
    assert len(lines) == logged
    assert [e["event"] for e in logs].count("request.finished") == 1


async def test_a_restart_that_hangs_is_abandoned_and_counts_as_a_failed_start(autojump_clock):
    worker = SimWorker(die_at_step=2, hang_at_start=2)
    assert await served_behind_a_crash(worker) == expected_tokens([3, 4], 5)
    assert worker._start_calls == 3 and worker.kills == 2  # the dead one, the hung start


async def test_a_device_error_fails_the_step_restarts_and_health_names_it(autojump_clock):
    worker = SimWorker(fault_at_step=3)
    config = sim_config(max_num_seqs=1)
    async with running_engine(config, worker) as engine:
        client = create_app(config, engine, SimTokenizer(), "sim").test_client()
        faulted = await engine.submit([1, 2, 3], greedy(20), request_id="faulted")
        queued = await engine.submit([4, 5], greedy(4), request_id="queued")
        with trio.fail_after(60):
            failed = await collect(faulted)
            restarting = await client.get("/health")  # the new worker takes 0.1 s to start
            served = await collect(queued)
        healthy = await client.get("/health")
        state = engine.state()
    assert (failed.finish.reason, failed.finish.detail) == ("error", "worker_died")
    assert failed.finish.error == "the worker exited after a device error"
    assert served.token_ids == expected_tokens([4, 5], 4)
    assert worker.kills == 1 and worker.starts == 2 and state["worker_restarts"] == 1
    assert state["last_worker_failure"]["reason"] == "device_error"
    assert "illegal memory access" in state["last_worker_failure"]["error"]
    assert (restarting.status_code, healthy.status_code) == (503, 200)
    for response in (restarting, healthy):
        body = await response.get_json()
        assert set(body["last_worker_failure"]) == {"reason", "at"}  # no error text in public
        assert body["last_worker_failure"]["reason"] == "device_error"


async def test_a_result_that_does_not_answer_its_plan_restarts_the_worker(autojump_clock):
    """A garbled result (here: its sampled sequences are not the plan's) is a worker gone
    wrong: the running request fails, the worker is replaced, the server goes on."""

    class GarblingWorker(SimWorker):
        async def receive_result(self, step_id: int):
            result = await super().receive_result(step_id)
            if self._calls == 3:
                result = dataclasses.replace(result, seq_ids=[], tokens=[])
            return result

    worker = GarblingWorker()
    async with running_engine(sim_config(max_num_seqs=1), worker) as engine:
        running = await engine.submit([1, 2, 3], greedy(20), request_id="running")
        queued = await engine.submit([4, 5], greedy(4), request_id="queued")
        with trio.fail_after(60):
            failed = await collect(running)
            served = await collect(queued)
    assert (failed.finish.reason, failed.finish.detail) == ("error", "worker_died")
    assert served.token_ids == expected_tokens([4, 5], 4)
    assert worker.starts == 2
