"""`cadence bench attention`: the command end to end on tiny shapes (its times are printed,
never asserted), offering what the chooser offers for those layers."""

from __future__ import annotations

from ops.commands import bench

TINY = ["--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--layers", "2", "--batch", "3"]
TINY += ["--context", "40", "--chunk", "17", "--repeats", "1"]


def test_it_times_every_backend_offered_for_a_model_with_sinks_and_windows(capsys):
    assert bench(["attention", *TINY, "--window", "16"]) == 0
    out = capsys.readouterr().out
    assert "(None, 16, None, True)" in out  # a windowed layer with sinks, then a full one
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rows == ["torch", "native-rows", "hybrid"]  # the chunk kernel has no windows


def test_without_windows_or_sinks_it_times_the_chunk_kernel_too(capsys):
    assert bench(["attention", *TINY, "--window", "0", "--no-sinks"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rows[:3] == ["torch", "native-rows", "hybrid"] and rows[3:] in ([], ["native"])
    assert all(float(value) >= 0 for line in out.splitlines()[2:] for value in line.split()[1:])
