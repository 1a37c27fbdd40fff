"""The engine end to end on the simulated worker: streams, finish reasons, errors."""

from __future__ import annotations

import pytest
import structlog
import structlog.testing
import trio

from policies.base import PolicyError
from service.engine.admission import Overloaded
from service.engine.engine import EngineUnavailable, InvalidRequest
from service.engine.request import SamplingParams, SamplingSpec
from tests.sim_worker import (
    EOS,
    Collected,
    RecordingObserver,
    SimTokenizer,
    SimWorker,
    collect,
    expected_tokens,
    greedy,
    running_engine,
    sim_config,
)

TOK = SimTokenizer()


async def test_stream_yields_tokens_then_one_finish(autojump_clock):
    async with running_engine() as engine:
        prompt = TOK.encode("hello world")
        events = await collect(await engine.submit(prompt, greedy(7), request_id="a"))
    assert events.token_ids == expected_tokens(prompt, 7)
    assert events.text == TOK.decode(events.token_ids)
    assert (events.finish.reason, events.finish.detail) == ("length", "max_tokens")
    assert (events.finish.prompt_tokens, events.finish.completion_tokens) == (len(prompt), 7)


async def test_eos_stops_unless_ignored(autojump_clock):
    prompt = TOK.encode("abc")
    stop_at = len(prompt) + 3  # the 4th generated token is EOS
    worker = SimWorker(eos_at=lambda seq, pos: pos == stop_at)
    async with running_engine(worker=worker) as engine:
        stopped = await collect(await engine.submit(prompt, greedy(10), request_id="a"))
        ignored = await collect(
            await engine.submit(prompt, greedy(10, ignore_eos=True), request_id="b")
        )
    assert (stopped.finish.reason, stopped.finish.detail) == ("stop", "eos")
    assert stopped.token_ids[-1] == EOS and len(stopped.token_ids) == 4
    assert "<eos>" not in stopped.text
    assert ignored.finish.detail == "max_tokens" and len(ignored.token_ids) == 10


async def test_stop_string_is_cut_with_what_follows(autojump_clock):
    prompt = TOK.encode("stop test")
    full = TOK.decode(expected_tokens(prompt, 20))
    stop = full[5:7]
    async with running_engine() as engine:
        events = await collect(await engine.submit(prompt, greedy(20, stop=[stop]), request_id="a"))
    cut = full.index(stop)
    assert events.text == full[:cut]
    assert (events.finish.reason, events.finish.detail) == ("stop", "stop_string")
    assert events.finish.completion_tokens == len(events.token_ids) == cut + len(stop)


def sampled(**spec) -> SamplingParams:
    return SamplingParams(max_tokens=4, sampling=SamplingSpec(**spec))


@pytest.mark.parametrize(
    ("prompt", "params", "param", "message"),
    [
        ([], greedy(4), "prompt", "empty"),
        ([1, 2, 999], greedy(4), "prompt", "token ids"),
        ([1, 2, -1], greedy(4), "prompt", "token ids"),
        ([1, 2], greedy(0), "max_tokens", "at least 1"),
        ([1] * 100, greedy(8100), "max_tokens", "maximum context length is 8192"),
        ([1, 2], sampled(top_p=0.0), "top_p", r"\(0, 1\]"),
        ([1, 2], sampled(top_p=1.5), "top_p", r"\(0, 1\]"),
        ([1, 2], sampled(temperature=-0.5), "temperature", "between 0 and 2"),
        ([1, 2], sampled(temperature=2.5), "temperature", "between 0 and 2"),
        ([1, 2], sampled(temperature=float("nan")), "temperature", "between 0 and 2"),
        ([1, 2], sampled(top_k=-2), "top_k", ">= 0"),
        ([1, 2], sampled(seed=-1), "seed", "integer in"),
        ([1, 2], sampled(seed=2**63), "seed", "integer in"),
        ([1, 2], greedy(4, stop=[3]), "stop", "non-empty strings"),
        ([1, 2], greedy(4, stop=[""]), "stop", "non-empty strings"),
        ([1, 2], greedy(4, stop=["a"] * 17), "stop", "at most 16"),
    ],
)
async def test_bad_requests_get_a_clear_error_naming_the_field(
    autojump_clock, prompt, params, param, message
):
    async with running_engine() as engine:
        with pytest.raises(InvalidRequest, match=message) as info:
            await engine.submit(prompt, params, request_id="x")
        assert info.value.param == param
        assert engine.state()["waiting"] == engine.state()["running"] == 0


@pytest.mark.parametrize(
    ("tenant", "priority", "param"),
    [
        ("", 0, "user"),
        ("t" * 129, 0, "user"),
        ("t", 10**6 + 1, "priority"),
        ("t", -(10**6) - 1, "priority"),
    ],
)
async def test_bad_tenant_or_priority_is_refused(autojump_clock, tenant, priority, param):
    async with running_engine() as engine:
        with pytest.raises(InvalidRequest) as info:
            await engine.submit([1], greedy(1), request_id="x", tenant=tenant, priority=priority)
        assert info.value.param == param


async def test_edges_of_the_ranges_are_accepted(autojump_clock):
    edges = [sampled(temperature=2.0, top_p=1.0, top_k=0, seed=2**63 - 1), sampled(seed=0)]
    async with running_engine(worker=SimWorker(num_blocks=1024)) as engine:
        for i, params in enumerate(edges):
            events = await collect(await engine.submit([1, 2], params, request_id=f"e{i}"))
            assert events.finish.reason == "length"
        events = await collect(
            await engine.submit([1] * 100, greedy(8092), request_id="fits", priority=10**6)
        )
        assert events.finish.completion_tokens == 8092


async def test_missing_max_tokens_means_the_rest_of_the_context(autojump_clock):
    async with running_engine(worker=SimWorker(max_model_len=64)) as engine:
        params = SamplingParams(max_tokens=None, sampling=SamplingSpec(temperature=0.0))
        events = await collect(await engine.submit([1] * 60, params, request_id="rest"))
    assert events.finish.detail == "max_tokens" and events.finish.completion_tokens == 4
    assert params.max_tokens is None  # the caller's record is not changed


async def test_request_longer_than_the_kv_cache_is_refused(autojump_clock):
    async with running_engine(worker=SimWorker(num_blocks=8)) as engine:
        with pytest.raises(InvalidRequest, match="KV cache"):
            await engine.submit([1] * 120, greedy(20), request_id="x")


async def test_duplicate_request_id_refused(autojump_clock):
    async with running_engine() as engine:
        await engine.submit([1, 2], greedy(4), request_id="same")
        with pytest.raises(InvalidRequest, match="already in use"):
            await engine.submit([1, 2], greedy(4), request_id="same")


async def test_full_queue_is_overloaded(autojump_clock):
    config = sim_config(max_queue=3, max_num_seqs=1)
    async with running_engine(config) as engine:
        for i in range(4):  # one runs (the only sequence slot), three wait
            await engine.submit([1, 2, 3], greedy(400), request_id=f"r{i}")
        assert (engine.state()["running"], engine.state()["waiting"]) == (1, 3)
        with pytest.raises(Overloaded):
            await engine.submit([1, 2, 3], greedy(4), request_id="one-too-many")


async def test_each_of_n_sequences_takes_a_place_in_the_queue(autojump_clock):
    config = sim_config(max_queue=3, max_num_seqs=1)
    async with running_engine(config) as engine:
        await engine.submit([1, 2, 3], greedy(400), request_id="runs")
        await engine.submit([1, 2, 3], greedy(400), request_id="waits")
        with pytest.raises(Overloaded):  # 1 waiting + 3 > 3
            await engine.submit([4, 5, 6], greedy(4), request_id="three", n=3)
        await engine.submit([4, 5, 6], greedy(400), request_id="two", n=2)  # 1 + 2 fits
        with pytest.raises(Overloaded):  # the held second sequence counts too
            await engine.submit([7, 8, 9], greedy(4), request_id="one")


async def test_submit_before_start_and_after_shutdown_is_unavailable(autojump_clock):
    from service.engine.engine import Engine

    engine = Engine(sim_config(), SimWorker(), TOK)
    with pytest.raises(EngineUnavailable):
        await engine.submit([1], greedy(1), request_id="early")
    async with running_engine() as engine:
        engine.begin_shutdown()
        with pytest.raises(EngineUnavailable):
            await engine.submit([1], greedy(1), request_id="late")


async def test_abort_frees_blocks_by_the_next_iteration(autojump_clock):
    worker = SimWorker()
    async with running_engine(worker=worker) as engine:
        keep = await engine.submit([5] * 40, greedy(200), request_id="keep")
        gone = await engine.submit([6] * 70, greedy(200), request_id="gone")
        while len(worker.plans) < 5:
            await trio.sleep(0.001)
        sched = engine.scheduler
        gone_seq = next(r.seq_id for r in sched.running if r.request_id == "gone")
        assert sched.blocks.num_held(gone_seq) > 0
        engine.abort("gone")
        engine.abort("gone")  # idempotent
        assert sched.blocks.num_held(gone_seq) == 0
        sched.blocks.check_invariants()
        steps_before = len(worker.plans)
        while len(worker.plans) < steps_before + 2:
            await trio.sleep(0.001)
        later = worker.plans[steps_before + 1 :]
        assert all(gone_seq not in p.seq_ids for p in later)
        engine.abort("keep")
        got_gone = await collect(gone)
        got_keep = await collect(keep)
        assert engine.state()["kv_blocks_used"] == 0
    assert (got_gone.finish.reason, got_gone.finish.detail) == ("abort", "aborted")
    assert got_keep.finish.reason == "abort"


async def test_abort_inside_a_cancelled_scope(autojump_clock):
    async with running_engine() as engine:
        channel = await engine.submit([1, 2, 3], greedy(500), request_id="c")
        with trio.CancelScope() as scope:
            scope.cancel()
            engine.abort("c")  # synchronous: works though every await would be cancelled
        events = await collect(channel)
        assert events.finish.detail == "aborted"


async def test_worker_death_fails_running_and_keeps_waiting(autojump_clock):
    worker = SimWorker(die_at_step=4)
    config = sim_config(max_num_seqs=1)  # the second request waits behind the first
    async with running_engine(config, worker) as engine:
        first = await engine.submit([1, 2, 3], greedy(10), request_id="first")
        second = await engine.submit([4, 5, 6], greedy(5), request_id="second")
        failed = await collect(first)
        survived = await collect(second)
        assert engine.ready
    assert (failed.finish.reason, failed.finish.detail) == ("error", "worker_died")
    assert failed.finish.error == "the worker process died"
    assert survived.finish.detail == "max_tokens"
    assert survived.token_ids == expected_tokens([4, 5, 6], 5)
    assert worker.starts == 2 and worker.stopped


async def test_set_policy_swaps_at_the_next_iteration(autojump_clock):
    worker = SimWorker()
    async with running_engine(worker=worker) as engine:
        channel = await engine.submit([1] * 10, greedy(30), request_id="a")
        while len(worker.plans) < 3:
            await trio.sleep(0.001)
        swap = engine.set_policy("fcfs", {})
        assert swap.old["name"] == "stall_free" and swap.new["name"] == "fcfs"
        assert engine.policy_info()["name"] == "fcfs"
        with pytest.raises(PolicyError):
            engine.set_policy("nope", {})
        with pytest.raises(PolicyError):
            engine.set_policy("stall_free", {"token_budget": -1})
        assert engine.policy_info()["name"] == "fcfs"
        events = await collect(channel)
    first_fcfs = swap.iteration
    assert first_fcfs >= 4
    assert [p.step_id for p in worker.plans] == list(range(1, len(worker.plans) + 1))
    assert len(events.token_ids) == 30
    assert events.token_ids == expected_tokens([1] * 10, 30)


async def test_drain_lets_short_finish_and_aborts_the_rest(autojump_clock):
    async with running_engine() as engine:
        short = await engine.submit([1, 2], greedy(3), request_id="short")
        long = await engine.submit([1, 2], greedy(5000), request_id="long")
        engine.begin_shutdown()
        done: list[Collected] = []

        async def read(ch):
            done.append(await collect(ch))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, short)
            nursery.start_soon(read, long)
            await engine.drain(timeout=1.0)
    details = sorted(c.finish.detail for c in done)
    assert details == ["max_tokens", "shutdown"]
    assert engine.state()["kv_blocks_used"] == 0


async def test_state_reports_the_engine(autojump_clock):
    async with running_engine() as engine:
        state = engine.state()
    assert state["worker_ready"] is True
    assert state["policy"]["name"] == "stall_free"
    assert state["kv_blocks_total"] == 512 and state["max_model_len"] == 8192
    assert (state["admission_paused"], state["kv_blocks_promised"]) == (False, 0)
    assert state["corrections"] == {}


async def test_preemption_by_recompute_keeps_outputs(autojump_clock):
    worker = SimWorker(num_blocks=10)  # three requests of 5 blocks each cannot all fit
    observer = RecordingObserver()
    async with running_engine(sim_config(watermark=0.0), worker) as engine:
        engine.add_observer(observer)
        prompts = [[i + 1] * 40 for i in range(3)]
        channels = [
            await engine.submit(p, greedy(40), request_id=f"p{i}") for i, p in enumerate(prompts)
        ]
        got = [await collect(c) for c in channels]
    assert observer.preempted, "no preemption happened"
    for p, events in zip(prompts, got, strict=True):
        assert events.token_ids == expected_tokens(p, 40)
    preempted = {s.request_id: s.preemptions for s in observer.finished}
    assert sum(preempted.values()) == len(observer.preempted)


async def test_swap_iteration_is_the_first_decided_by_the_new_policy(autojump_clock):
    observer = RecordingObserver()
    worker = SimWorker()
    async with running_engine(worker=worker) as engine:
        engine.add_observer(observer)
        channel = await engine.submit([1] * 10, greedy(20), request_id="a")
        while len(worker.plans) < 4:
            await trio.sleep(0.001)
        swap = engine.set_policy("fair", {})
        await collect(channel)
    by_iteration = {s.iteration: s.policy for s in observer.iterations}
    assert by_iteration[swap.iteration] == "fair"
    assert by_iteration[swap.iteration - 1] == "stall_free"
    assert observer.swaps == [("stall_free", "fair", swap.iteration)]


async def test_log_events_carry_the_agreed_fields(autojump_clock):
    with structlog.testing.capture_logs() as logs:
        async with running_engine() as engine:
            await collect(await engine.submit([1, 2, 3], greedy(4), request_id="log"))
            engine.set_policy("fcfs", None, by="test")
    events = {}
    for entry in logs:
        events.setdefault(entry["event"], entry)
    assert set(events) >= {
        "worker.started",
        "request.received",
        "request.admitted",
        "request.first_token",
        "request.finished",
        "iteration",
        "policy.swap",
    }
    assert set(events["iteration"]) >= {
        "iteration", "policy", "prefill_tokens", "decode_seqs", "batch_tokens", "num_seqs",
        "running", "waiting", "kv_blocks_used", "kv_blocks_total", "step_ms", "schedule_ms",
        "preempted", "worker_idle_ms",
    }  # fmt: skip
    finished = events["request.finished"]
    assert finished["completion_tokens"] == 4 and finished["finish_reason"] == "length"
    assert finished["ttft_ms"] > 0 and finished["itl_p99_ms"] >= finished["itl_p50_ms"] > 0
    assert events["policy.swap"]["by"] == "test"
    assert "worker.device_warning" not in events


async def test_a_worker_serving_on_the_cpu_beside_a_gpu_is_logged_as_a_warning(autojump_clock):
    warning = "a GPU is visible but torch is a build without CUDA: serving on the CPU"
    with structlog.testing.capture_logs() as logs:
        async with running_engine(worker=SimWorker(device_warning=warning)):
            pass
    [logged] = [entry for entry in logs if entry["event"] == "worker.device_warning"]
    assert (logged["log_level"], logged["warning"]) == ("warning", warning)


async def test_a_submitter_cancelled_while_queued_leaves_other_requests_alone(autojump_clock):
    async with running_engine() as engine:
        first = await engine.submit([1, 2, 3], greedy(6), request_id="same")
        with trio.CancelScope() as scope:
            scope.cancel()
            await engine.submit([1, 2, 3], greedy(6), request_id="same")  # refused anyway
        with trio.CancelScope() as scope:
            scope.cancel()
            await engine.submit([4, 5], greedy(6), request_id="gone")  # cancelled in the queue
        events = await collect(first)
        await trio.sleep(1)
        assert engine.state()["waiting"] == engine.state()["running"] == 0
    assert (events.finish.reason, events.finish.completion_tokens) == ("length", 6)
