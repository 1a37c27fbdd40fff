"""WorkerLink against a fake child process: handshake, steps, death, fatal, kill."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from gpu_worker.protocol import BatchPlan, SamplingSpec, WorkerConfig
from service.engine.worker_link import WorkerDied, WorkerLink, WorkerStartError

CHILD = str(Path(__file__).with_name("fake_worker_child.py"))


def link(mode: str, **kw) -> WorkerLink:
    env = dict(os.environ, FAKE_WORKER_MODE=mode)
    return WorkerLink(
        WorkerConfig(model_dir="/none"), command=[sys.executable, CHILD], env=env, **kw
    )


def plan(step_id: int) -> BatchPlan:
    return BatchPlan(
        step_id=step_id,
        seq_ids=[1, 2],
        num_tokens=[3, 1],
        start_pos=[0, 7],
        input_ids=[5, 6, 7, 8],
        block_tables=[[0], [1]],
        sample=[True, False],
        sampling=[SamplingSpec(), SamplingSpec()],
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_handshake_steps_and_clean_stop():
    worker = link("ok")
    handshake = await worker.start()
    assert handshake.num_blocks == 64 and handshake.pid == worker.pid
    for step_id in (1, 2, 3):
        result = await worker.step(plan(step_id))
        assert (result.step_id, result.seq_ids, result.tokens) == (step_id, [1], [1000 + step_id])
    pid = worker.pid
    await worker.stop()
    assert worker.returncode == 0 and not alive(pid)  # exited and reaped


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
