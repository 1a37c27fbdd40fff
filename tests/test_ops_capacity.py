"""`cadence bench capacity`: the mixed workload, SLO attainment, the capacity rule and the
command end to end against a fake streaming server."""

import dataclasses
import random

import orjson
import pytest
import trio

from ops import scenarios
from ops.capacity_report import (
    Capacity,
    attainments,
    bisection_rate,
    capacity_of,
    rate_result,
    target_result,
)
from ops.client import RequestRecord
from ops.commands import bench as main
from ops.prompts import PromptMaker, load_codec
from ops.summary import SLO, meets_slo, percentile
from tests.ops_fakes import FakeServer, train_tokenizer_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DEFAULT_SHAPE = scenarios.MixedShape(
    prompt=scenarios.LogNormal(256, 1.0, scenarios.LengthRange(16, 2048)),
    output=scenarios.LogNormal(128, 0.8, scenarios.LengthRange(8, 512)),
    doc_share=0.1,
    doc=scenarios.LengthRange(2000, 4000),
)
# small enough for the trained test tokenizer and a fake server to answer in moments
TINY_SHAPE = scenarios.MixedShape(
    prompt=scenarios.LogNormal(16, 1.0, scenarios.LengthRange(8, 32)),
    output=scenarios.LogNormal(4, 0.5, scenarios.LengthRange(3, 6)),
    doc_share=0.3,
    doc=scenarios.LengthRange(40, 60),
    context_window=128,
)
TINY_SHAPE_ARGS = ["--prompt-median", "16", "--prompt-clip", "8:32", "--output-median", "4",
                   "--output-sigma", "0.5", "--output-clip", "3:6", "--doc-share", "0.3",
                   "--doc-len", "40:60", "--context-window", "128"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return str(train_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.fixture(scope="module")
def large_plan():
    return scenarios.mixed_plan(random.Random(0), 50, 200, DEFAULT_SHAPE)


# the mixed workload


def test_mixed_plan_is_seeded_and_keeps_each_request_s_lengths_across_rates():
    def plan(seed, rate):
        return scenarios.mixed_plan(random.Random(seed), rate, 30, DEFAULT_SHAPE)

    assert plan(3, 2) == plan(3, 2)
    assert plan(3, 2) != plan(4, 2)
    slow, fast = plan(3, 2), plan(3, 4)
    assert len(fast) > len(slow)
    for a, b in zip(slow, fast, strict=False):
        assert (a.prompt_len, a.max_tokens, a.role) == (b.prompt_len, b.max_tokens, b.role)
        assert b.arrival_s == pytest.approx(a.arrival_s / 2)


def test_mixed_lengths_are_clipped_and_the_clips_bind(large_plan):
    chat = [p.prompt_len for p in large_plan if p.role == "chat"]
    docs = [p.prompt_len for p in large_plan if p.role == "document"]
    outputs = [p.max_tokens for p in large_plan]
    assert min(chat) == 16 and max(chat) == 2048
    assert min(outputs) == 8 and max(outputs) == 512
    assert min(docs) >= 2000 and max(docs) <= 4000
    assert all(p.prompt_len + p.max_tokens <= scenarios.CONTEXT_WINDOW for p in large_plan)


def test_mixed_document_share_rate_and_long_tail(large_plan):
    n = len(large_plan)
    assert sum(p.role == "document" for p in large_plan) / n == pytest.approx(0.1, abs=0.015)
    assert n / 200 == pytest.approx(50, rel=0.04)  # Poisson: n ~ 10,000, sd 1 %
    arrivals = [p.arrival_s for p in large_plan]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0 and arrivals[-1] < 200
    chat = [p.prompt_len for p in large_plan if p.role == "chat"]
    outputs = [p.max_tokens for p in large_plan]
    assert percentile(chat, 50) == pytest.approx(256, rel=0.05)
    assert percentile(outputs, 50) == pytest.approx(128, rel=0.05)
    assert percentile(chat, 99) / percentile(chat, 50) > 5
    assert percentile(outputs, 99) / percentile(outputs, 50) > 3


def test_mixed_shape_is_checked():
    clip = scenarios.LengthRange(8, 64)
    with pytest.raises(ValueError, match="median"):
        scenarios.LogNormal(100, 1.0, clip)
    with pytest.raises(ValueError, match="sigma"):
        scenarios.LogNormal(16, -1.0, clip)
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        scenarios.MixedShape(DEFAULT_SHAPE.prompt, DEFAULT_SHAPE.output, 1.5, clip)
    with pytest.raises(ValueError, match="does not fit the 4096-token context window"):
        scenarios.MixedShape(
            DEFAULT_SHAPE.prompt, DEFAULT_SHAPE.output, 0.1, DEFAULT_SHAPE.doc, 4096
        )
    # without documents only the chat prompts must fit
    scenarios.MixedShape(DEFAULT_SHAPE.prompt, DEFAULT_SHAPE.output, 0.0, DEFAULT_SHAPE.doc, 4096)


def test_mixed_specs_carry_prompts_of_their_planned_lengths(tokenizer_json):
    codec = load_codec(tokenizer_json)
    specs = scenarios.mixed(
        PromptMaker(codec), random.Random(5), rate=20, duration_s=1, shape=TINY_SHAPE
    )
    plan = scenarios.mixed_plan(random.Random(5), 20, 1, TINY_SHAPE)
    assert [(s.arrival_s, s.prompt_len, s.max_tokens, s.role) for s in specs] == [
        (p.arrival_s, p.prompt_len, p.max_tokens, p.role) for p in plan
    ]
    assert {s.role for s in specs} == {"chat", "document"}
    assert all(len(codec.encode(s.prompt)) == s.prompt_len for s in specs)


# SLO attainment of one request


def record(chunks, send=0.0, error=None):
    return RequestRecord(
        index=0,
        role="chat",
        tenant=None,
        arrival_s=send,
        prompt_len=10,
        max_tokens=len(chunks),
        send_s=send,
        first_token_s=chunks[0] if chunks else None,
        end_s=chunks[-1] if chunks else send + 1,
        chunk_times=list(chunks),
        error=error,
    )


def with_one_stall(gap_count, stall=2.0, fast=0.010):
    """Chunks 10 ms apart but for one 2 s stall, in the middle."""
    gaps = [fast] * gap_count
    gaps[gap_count // 2] = stall
    times = [0.1]
    for gap in gaps:
        times.append(times[-1] + gap)
    return record(times)


def test_one_stall_fails_a_short_request_s_p99_but_not_a_long_one_s():
    short = with_one_stall(20)  # p99 of 20 gaps lies 81 % of the way to the stall: ~1.6 s
    assert not meets_slo(short, SLO(3000, 500))
    assert not meets_slo(short, SLO(3000, 1000))
    assert meets_slo(short, SLO(3000, 2000))
    long = with_one_stall(200)  # p99 of 200 gaps is a fast gap: one stall in 200 is allowed
    assert all(meets_slo(long, SLO(3000, t)) for t in (250, 500, 1000))


def test_a_failed_request_never_meets_a_target_and_the_ttft_bound_is_inclusive():
    fast = [3.0, 3.01, 3.02]
    assert meets_slo(record(fast), SLO(3000, 1000))  # TTFT exactly 3000 ms
    assert not meets_slo(record([3.001, 3.01, 3.02]), SLO(3000, 1000))
    assert not meets_slo(record([0.1, 0.11], error="HTTP 429: overloaded"), SLO(3000, 1000))
    assert not meets_slo(record([]), SLO(None, None))


def test_target_result_counts_attainment_and_goodput_over_the_arrival_window():
    records = [record([0.1, 0.12]), with_one_stall(20), record([0.1], error="timeout after 5 s")]
    loose, tight = (target_result(records, 2.0, SLO(3000, t)) for t in (2000, 500))
    assert loose == {
        "itl_p99_ms": 2000,
        "met": 2,
        "attainment": 2 / 3,
        "goodput_requests_per_s": 1.0,
    }
    assert (tight["met"], tight["attainment"]) == (1, 1 / 3)
    run = rate_result(records, 1.5, 2.0, 3000, [500, 2000])
    assert run["summary"]["failed"] == 1
    assert run["request_itl_p99_ms"]["n"] == 2
    assert attainments([run], 2000) == {1.5: 2 / 3}


# the capacity rule and its bisection


def test_capacity_of_a_monotone_sweep_and_its_bisection():
    attainment = {0.25: 1.0, 0.5: 0.9, 1: 0.6, 2: 0.1}  # 0.9 exactly passes
    assert capacity_of(attainment, 0.9) == Capacity(0.5, 1, False, False)
    assert bisection_rate(attainment, 0.9) == 0.75


def test_capacity_when_the_lowest_rate_fails_or_every_rate_passes():
    assert capacity_of({0.25: 0.5, 1: 0.2}, 0.9) == Capacity(None, 0.25, True, False)
    assert bisection_rate({0.25: 0.5, 1: 0.2}, 0.9) is None
    assert capacity_of({0.25: 1.0, 2: 0.95}, 0.9) == Capacity(2, None, False, True)
    assert bisection_rate({0.25: 1.0, 2: 0.95}, 0.9) is None


def test_a_pass_above_a_failing_rate_is_not_capacity():
    attainment = {0.25: 1.0, 0.5: 0.5, 1: 0.95}
    assert capacity_of(attainment, 0.9) == Capacity(0.25, 0.5, False, False)
    assert bisection_rate(attainment, 0.9) == 0.375


def test_bisection_closes_in_on_the_true_capacity():
    def attainment_at(rate):  # a server that holds its SLO up to 0.8 requests/s
        return 1.0 if rate <= 0.8 else 0.3

    runs = {rate: attainment_at(rate) for rate in (0.5, 1.0)}
    tried = []
    for _ in range(3):
        rate = bisection_rate(runs, 0.9)
        tried.append(rate)
        runs[rate] = attainment_at(rate)
    assert tried == [0.75, 0.875, 0.8125]
    assert capacity_of(runs, 0.9) == Capacity(0.75, 0.8125, False, False)


# the command


async def run_main(argv):
    return await trio.to_thread.run_sync(main, argv)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rates", "0.5,fast"], "--rates '0.5,fast' is not a comma-separated list"),
        (["--rates", "0,1"], "--rates '0,1' needs one or more numbers > 0"),
        (["--rates", ""], "needs one or more numbers > 0"),
        (["--attainment", "1.5"], "--attainment 1.5 must be in (0, 1]"),
        (["--attainment", "0"], "--attainment 0 must be in (0, 1]"),
        (["--bisect-target", "700"], "--bisect-target 700 is not one of --itl-p99-ms"),
        (["--policy", "fcfs"], "--policy needs --admin-token"),
        (["--policy", "fcfs:{oops", "--admin-token", "t"], "are not JSON"),
        (["--doc-share", "2"], "document share 2 is outside 0..1"),
        (["--prompt-clip", "64:8"], "must satisfy 1 <= LO <= HI"),
        (["--merge", "/nonexistent/run"], "cannot read /nonexistent/run/capacity.json"),
    ],
)
async def test_bad_flags_exit_2_with_a_clear_message(flags, message, tmp_path, capsys):
    assert await run_main(["capacity", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cadence bench capacity: ") and message in err


def capacity_argv(url, tokenizer_json, out, *flags):
    return ["capacity", "--url", url, "--tokenizer", tokenizer_json, "--out", str(out),
            "--seed", "0", "--duration", "0.5", *TINY_SHAPE_ARGS, *flags]  # fmt: skip


async def test_a_sweep_per_policy_meets_a_loose_target_and_misses_a_tight_one(
    nursery, tmp_path, tokenizer_json, capsys
):
    server = FakeServer(token_gap_s=0.03)  # chunks sent 30 ms apart, the first after 30 ms
    await nursery.start(server.serve)
    out = tmp_path / "run"
    argv = capacity_argv(server.url, tokenizer_json, out, "--rates", "20,10",
                         "--itl-p99-ms", "1,5000", "--label", "fake", "--policy", "fcfs",
                         "--policy", "stall_free", "--admin-token", "sekret")  # fmt: skip
    assert await run_main(argv) == 0

    assert [put for put, _ in server.policy_puts] == [
        {"name": "fcfs", "params": {}},
        {"name": "stall_free", "params": {}},
    ]
    doc = orjson.loads((out / "capacity.json").read_bytes())
    assert doc["config"]["rates"] == "20,10" and doc["workload"]["seed"] == 0
    assert doc["workload"]["shape"]["doc_share"] == 0.3
    assert doc["workload"]["shape"]["prompt"] == {"median": 16, "sigma": 1.0,
                                                  "clip": {"lo": 8, "hi": 32}}  # fmt: skip
    assert [s["name"] for s in doc["sweeps"]] == ["fake/fcfs", "fake/stall_free"]
    for sweep in doc["sweeps"]:
        assert sweep["model"] == "fake-model" and sweep["slo"]["bisect_target"] == 5000
        assert [(r["rate"], r["bisection"]) for r in sweep["runs"]] == [(10, False), (20, False)]
        for run in sweep["runs"]:
            requests = run["requests"]
            assert len(requests) == run["summary"]["requests"] > 0
            assert all(r["error"] is None and len(r["chunk_times"]) >= 3 for r in requests)
            assert {r["role"] for r in requests} <= {"chat", "document"}
            tight, loose = run["targets"]
            assert (tight["met"], loose["met"]) == (0, len(requests))
            assert loose["goodput_requests_per_s"] == len(requests) / 0.5
            assert run["request_itl_p99_ms"]["p50"] > 1
        assert sweep["capacity"] == [
            {"itl_p99_ms": 1, "rate": None, "lowest_failing": 10, "below_lowest": True,
             "at_least_highest": False},
            {"itl_p99_ms": 5000, "rate": 20, "lowest_failing": None, "below_lowest": False,
             "at_least_highest": True},
        ]  # fmt: skip

    # same seed, same requests: what a server got at 10/s is what the workload builder makes
    specs = scenarios.mixed(
        PromptMaker(load_codec(tokenizer_json)),
        random.Random(0),
        rate=10,
        duration_s=0.5,
        shape=TINY_SHAPE,
    )
    at_10 = server.bodies[: len(specs)]
    assert sorted((b["prompt"], b["max_tokens"]) for b in at_10) == sorted(
        (s.prompt, s.max_tokens) for s in specs
    )

    summary = (out / "summary.txt").read_text()
    assert summary.strip() in capsys.readouterr().out
    capacity_rows = summary.split("capacity (requests/s)")[1]
    assert "fake/fcfs" in capacity_rows and "< 10" in capacity_rows and ">= 20" in capacity_rows
    assert "rates run: 10, 20" in summary
    data = (out / "attainment.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


async def test_rejections_make_a_rate_fail_and_bisection_refines_between(
    nursery, tmp_path, tokenizer_json
):
    # three streams at once at most; a request streams 20 tokens >= 20 ms apart (>= 0.4 s),
    # so the 2 requests at 4/s always pass and most of the 32 at 80/s get 429
    server = FakeServer(token_gap_s=0.02, max_streams=3)
    await nursery.start(server.serve)
    out = tmp_path / "run"
    argv = capacity_argv(server.url, tokenizer_json, out, "--rates", "4,80",
                         "--itl-p99-ms", "5000", "--output-median", "20",
                         "--output-sigma", "0", "--output-clip", "20:20", "--doc-share", "0",
                         "--no-plots")  # fmt: skip
    assert await run_main(argv) == 0

    (sweep,) = orjson.loads((out / "capacity.json").read_bytes())["sweeps"]
    runs = {run["rate"]: run for run in sweep["runs"]}
    assert not runs[4]["bisection"] and runs[4]["targets"][0]["attainment"] == 1.0
    rejected = [r for r in runs[80]["requests"] if r["status"] == 429]
    assert rejected and all(r["error"].startswith("HTTP 429") for r in rejected)
    assert runs[80]["summary"]["failed"] == len(rejected)
    assert runs[80]["targets"][0]["attainment"] < 0.9
    # two bisection runs: the midpoint of 4 and 80, then of the bracket that result leaves
    assert runs[42]["bisection"]
    second = 23 if runs[42]["targets"][0]["attainment"] < 0.9 else 61
    assert sorted(runs) == sorted([4, 42, 80, second]) and runs[second]["bisection"]
    expected = capacity_of(attainments(sweep["runs"], 5000), 0.9)
    assert sweep["capacity"][0]["rate"] == expected.rate
    assert sweep["capacity"][0]["lowest_failing"] == expected.lowest_failing
    assert "42*" in (out / "summary.txt").read_text()
    assert not (out / "attainment.png").exists()


def finished_sweep(name, attainment_by_rate):
    """A capacity.json sweep of synthetic runs: `round(share * 10)` of 10 requests are fast."""
    runs = []
    for rate, share in attainment_by_rate.items():
        met = round(share * 10)
        records = [record([0.1, 0.12])] * met + [record([0.1, 2.5])] * (10 - met)
        runs.append({**rate_result(records, rate, 10.0, 3000, [500]), "bisection": False})
    return {
        "name": name,
        "url": "http://x",
        "model": "m",
        "slo": {"ttft_ms": 3000, "itl_p99_ms": [500], "attainment": 0.9, "bisect_target": 500},
        "runs": runs,
        "capacity": [{"itl_p99_ms": 500, **capacity_dict(attainment_by_rate)}],
    }


def capacity_dict(attainment_by_rate):
    found = capacity_of(attainment_by_rate, 0.9)
    return {
        "rate": found.rate,
        "lowest_failing": found.lowest_failing,
        "below_lowest": found.below_lowest,
        "at_least_highest": found.at_least_highest,
    }


async def test_merge_puts_finished_sweeps_in_one_table_and_plot(tmp_path, capsys):
    sweeps = {
        "cadence": finished_sweep("cadence", {0.5: 1.0, 1: 0.9, 2: 0.4}),
        "vllm": finished_sweep("vllm", {0.5: 1.0, 1: 0.6, 2: 0.1}),
        "again": finished_sweep("cadence", {0.5: 0.5, 1: 0.1}),
    }
    for directory, sweep in sweeps.items():
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "capacity.json").write_bytes(orjson.dumps({"sweeps": [sweep]}))
    out = tmp_path / "merged"
    dirs = [str(tmp_path / d) for d in sweeps]
    assert await run_main(["capacity", "--merge", *dirs, "--out", str(out)]) == 0

    summary = (out / "summary.txt").read_text()
    assert summary.strip() in capsys.readouterr().out
    header, _, row = summary.split("capacity (requests/s)\n")[1].splitlines()
    assert header.split()[3:] == ["cadence", "vllm", "cadence", "(again)"]
    assert row.split() == ["500", "ms", "1", "(2", "fails)", "0.5", "(1", "fails)", "<", "0.5"]
    assert (out / "attainment.png").read_bytes().startswith(PNG_MAGIC)
    assert not (out / "capacity.json").exists()


async def test_rescore_judges_the_recorded_requests_against_another_slo(tmp_path):
    # 10 requests a run: `met` of them fast, the rest with one 2.4 s gap between chunks
    runs = []
    for rate, met in ((0.5, 10), (1, 8), (2, 3)):
        records = [record([0.1, 0.12])] * met + [record([0.1, 2.5])] * (10 - met)
        run = {**rate_result(records, rate, 10.0, 3000, [500]), "bisection": False}
        run["requests"] = [dataclasses.asdict(r) for r in records]
        runs.append(run)
    sweep = {
        "name": "cadence",
        "url": "http://x",
        "model": "m",
        "slo": {"ttft_ms": 3000, "itl_p99_ms": [500], "attainment": 0.9, "bisect_target": 500},
        "runs": runs,
        "capacity": [{"itl_p99_ms": 500, **capacity_dict({0.5: 1.0, 1: 0.8, 2: 0.3})}],
    }
    (tmp_path / "run").mkdir()
    document = {"sweeps": [sweep], "workload": {"duration_s": 10.0}}
    (tmp_path / "run" / "capacity.json").write_bytes(orjson.dumps(document))
    out = tmp_path / "rescored"
    argv = ["capacity", "--merge", str(tmp_path / "run"), "--rescore", "--out", str(out),
            "--itl-p99-ms", "500,3000", "--attainment", "0.75", "--no-plots"]  # fmt: skip
    assert await run_main(argv) == 0
    rows = (out / "summary.txt").read_text().split("capacity (requests/s)\n")[1].splitlines()
    # 500 ms: 1.0, 0.8, 0.3 against 75 %; 3000 ms: every recorded request meets it
    assert rows[2].split() == ["500", "ms", "1", "(2", "fails)"]
    assert rows[3].split() == ["3000", "ms", ">=", "2"]
    assert "met@3000" in (out / "summary.txt").read_text()
