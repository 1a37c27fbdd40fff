"""`cadence bench pd-interference --quick` end to end: it starts `cadence pd` (the real model,
Mooncake over loopback, vllm-router) and a colocated `cadence serve --policy stall_free`,
runs the interference scenario's decoders alone and then with prompts injected against
each, prints one table of the decoders' worst gap beside their baseline's and the injected
prompts' TTFT, writes the same in JSON, and stops every process it started. The figures
themselves are not checked here (two cores shared with the rest of CI): BENCHMARKS.md has
them from a quiet machine."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest

from ops.commands import bench
from ops.pd_interference import QUICK
from tests.server_fixtures import cache_dir

pytestmark = pytest.mark.real_model
SETUPS = ("pd", "colocated")
INJECTED = [64, 256]  # QUICK's


def test_quick_run_prints_both_setups_gaps_and_the_injected_prompts_ttft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["pd-interference", "--quick", "--out", str(tmp_path), "--no-plots",
            "--", "--device", "cpu", "--cache-dir", str(cache_dir())]  # fmt: skip
    assert bench(argv) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("setup "))
    assert header.split() == ["setup", "run", "worst", "gap", "ms", "gap", "/", "baseline",
                              "ITL", "p50", "ms", "ITL", "p99", "ms",
                              "TTFT", "64", "ms", "TTFT", "256", "ms"]  # fmt: skip
    assert "--cpu-threads 1" in printed and "--cpu-threads 2" in printed
    document = orjson.loads((tmp_path / "pd-interference.json").read_bytes())
    assert list(document) == list(SETUPS)
    for name in SETUPS:
        baseline, injected = document[name]["baseline"], document[name]["injected"]
        for run in (baseline, injected):
            decoders = run["decoders"]
            assert decoders["requests"] == decoders["succeeded"] == QUICK["decoders"]
            assert 0 < decoders["itl_ms"]["p50"] <= run["worst_gap_ms"]
        assert baseline["interference"] == []
        windows = injected["interference"]
        assert [w["prompt_len"] for w in windows] == INJECTED
        assert all(w["injected_ttft_ms"] > 0 and w["injected_error"] is None for w in windows)
        assert all(w["decoders_active"] > 0 for w in windows)  # they streamed meanwhile
    pd = document["pd"]
    row = next(
        line for line in printed.splitlines() if line.startswith("pd  ") and "injected" in line
    )
    assert f"{pd['injected']['worst_gap_ms'] / pd['baseline']['worst_gap_ms']:.2f}" in row.split()
    for name in SETUPS:  # stopped: nothing answers there any more
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{document[name]['url']}/health", timeout=5)


def test_a_bad_injection_exits_2_before_starting_anything(tmp_path: Path) -> None:
    argv = ["pd-interference", "--inject", "1024", "--out", str(tmp_path)]
    assert bench(argv) == 2
    assert not (tmp_path / "logs").exists()  # no server was started
