"""WorkerLink against a fake child process: handshake, steps, death, fatal, kill."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from gpu_worker.protocol import NewSeq, Row, SamplingSpec, StepPlan, WorkerConfig
from service.engine.worker_link import (
    WorkerDeviceFault,
    WorkerDied,
    WorkerLink,
    WorkerStartError,
)
from tests.server_fixtures import alive

CHILD = str(Path(__file__).with_name("fake_worker_child.py"))


def link(mode: str, **kw) -> WorkerLink:
    env = dict(os.environ, FAKE_WORKER_MODE=mode)
    return WorkerLink(
        WorkerConfig(model_dir="/none"), command=[sys.executable, CHILD], env=env, **kw
    )


def plan(step_id: int) -> StepPlan:
    return StepPlan(
        step_id,
        [Row(1, 3, 0, blocks=[[0]]), Row(2, 1, 7, blocks=[[1]], sample=False)],
        [5, 6, 7, 8],
        new=[NewSeq(1, SamplingSpec(), 3), NewSeq(2, SamplingSpec(), 7)],
        finished=[1, 2],
    )


async def test_handshake_steps_and_clean_stop():
    worker = link("ok")
    handshake = await worker.start()
    assert handshake.num_blocks == 64 and handshake.pid == worker.pid
    for step_id in (1, 2, 3):
        result = await worker.step(plan(step_id))
        assert (result.step_id, result.seq_ids, result.tokens) == (step_id, [1], [[1000 + step_id]])
    pid = worker.pid
    await worker.stop()
    assert worker.returncode == 0 and not alive(pid)  # exited and reaped


async def test_a_step_in_two_calls_and_a_result_for_another_step_is_an_error():
    worker = link("ok")
    await worker.start()
    await worker.send_step(plan(1))
    result = await worker.receive_result(1)
    assert (result.step_id, result.tokens, result.idle_ms) == (1, [[1001]], None)
    await worker.send_step(plan(2))
    with pytest.raises(WorkerDied, match="result for step 2, expected 3"):
        await worker.receive_result(3)
    await worker.stop()


async def test_death_mid_run_raises_worker_died_and_restart_works():
    worker = link("die_on_step_2")
    await worker.start()
    await worker.step(plan(1))
    with pytest.raises(WorkerDied):
        await worker.step(plan(2))
    first_pid = worker.pid
    await worker.start()  # reaps the dead one, spawns a new one
    assert worker.pid != first_pid and not alive(first_pid)
    await worker.step(plan(1))
    await worker.stop()


@pytest.mark.parametrize(
    "mode",
    ["garbled_on_step_2", "list_on_step_2", "unknown_field_on_step_2", "short_tokens_on_step_2"],
)
async def test_a_garbled_result_is_a_dead_worker_to_restart_not_an_error_of_the_server(mode):
    worker = link(mode)
    await worker.start()
    await worker.step(plan(1))
    with pytest.raises(WorkerDied, match="garbled"):
        await worker.step(plan(2))
    await worker.start()  # the engine's recovery: a new worker
    assert (await worker.step(plan(1))).tokens == [[1001]]
    await worker.stop()


async def test_a_device_error_reported_in_a_step_raises_worker_device_fault():
    worker = link("device_error_on_step_2")
    await worker.start()
    await worker.step(plan(1))
    with pytest.raises(WorkerDeviceFault, match="CUDA error"):
        await worker.step(plan(2))
    await worker.stop()  # reaps it
    assert worker.returncode == 3  # it exited on its own, having said why


async def test_fatal_at_init_is_a_clear_start_error():
    worker = link("fatal")
    with pytest.raises(WorkerStartError, match="no such model"):
        await worker.start()
    assert worker.returncode is not None


async def test_exit_at_init_is_a_start_error_with_the_code():
    worker = link("exit_at_init")
    with pytest.raises(WorkerStartError, match="code 3"):
        await worker.start()


async def test_a_worker_that_ignores_shutdown_is_killed():
    worker = link("ignore_shutdown", stop_timeout=0.5)
    await worker.start()
    pid = worker.pid
    with trio.fail_after(10):
        await worker.stop()
    assert worker.returncode is not None and worker.returncode < 0 and not alive(pid)


async def test_missing_executable_is_a_start_error():
    worker = WorkerLink(WorkerConfig(model_dir="/none"), command=["/nonexistent/python"])
    with pytest.raises(WorkerStartError):
        await worker.start()


async def test_ping_round_trips_and_a_cancelled_ping_does_not_confuse_the_next_step():
    worker = link("slow_pong")
    await worker.start()
    await worker.ping()
    with trio.move_on_after(0.1):  # cancelled while its pong is still on the way
        await worker.ping()
    result = await worker.step(plan(1))  # the late pong is skipped, the result is the step's
    assert result.step_id == 1
    await worker.ping()
    await worker.stop()


async def test_wait_closed_returns_when_the_idle_worker_exits():
    worker = link("ok")
    handshake = await worker.start()
    with trio.move_on_after(0.3) as idle:
        await worker.wait_closed()
    assert idle.cancelled_caught  # alive: it keeps waiting
    os.kill(handshake.pid, 9)
    with trio.fail_after(10):
        await worker.wait_closed()
    await worker.kill()
    assert not alive(handshake.pid)


async def test_kill_ends_a_stopped_worker_at_once():
    worker = link("ok", stop_timeout=30)
    handshake = await worker.start()
    os.kill(handshake.pid, 19)  # SIGSTOP: it can answer nothing, not even a shutdown
    with trio.fail_after(5):
        await worker.kill()
    assert not alive(handshake.pid)


async def test_the_worker_does_not_inherit_the_admin_token():
    child_env = await child_env_of(CADENCE_ADMIN_TOKEN="secret")
    assert "CADENCE_ADMIN_TOKEN" not in child_env and child_env["FAKE_WORKER_MODE"] == "ok"


async def child_env_of(**variables: str) -> dict[str, str]:
    env = dict(os.environ, FAKE_WORKER_MODE="ok", **variables)
    worker = WorkerLink(WorkerConfig(model_dir="/none"), command=[sys.executable, CHILD], env=env)
    await worker.start()
    await worker._send({"type": "env"})
    child_env = (await worker._receive())["env"]
    await worker.stop()
    return child_env


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, "glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
        ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # the operator's choice stands
    ],
)
async def test_the_worker_asks_glibc_for_huge_pages(given, expected, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    variables = {} if given is None else {"GLIBC_TUNABLES": given}
    assert (await child_env_of(**variables))["GLIBC_TUNABLES"] == expected


async def test_start_warms_the_worker_up_with_a_prefill_and_a_decode_step():
    """Then a plan that only finishes the warm-up's sequence: the worker holds nothing."""
    worker = link("ok")
    await worker.start()
    await worker._send({"type": "warm_ups"})
    assert (await worker._receive())["count"] == 3
    await worker.stop()
