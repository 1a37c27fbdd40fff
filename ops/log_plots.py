"""PNG plots of a parsed cadence log (matplotlib figures rendered by Agg)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ops.figures import label_axes, save
from ops.log_parse import FinishedRequest, Iteration, Swap


def _mark_swaps(ax: Axes, swaps: Sequence[Swap], t0: float) -> None:
    for swap in swaps:
        ax.axvline(swap.ts - t0, color="black", ls="--", lw=1)
        ax.annotate(
            f"-> {swap.new}",
            (swap.ts - t0, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            va="top",
            ha="left",
            fontsize=8,
        )


def plot_iteration_tokens(
    iterations: Sequence[Iteration], swaps: Sequence[Swap], t0: float, path: Path
) -> Path:
    """Prefill tokens and decode tokens of every iteration over time."""
    fig = Figure(figsize=(10, 4.5))
    ax = fig.add_subplot()
    times = [it.ts - t0 for it in iterations]
    ax.plot(times, [it.prefill_tokens for it in iterations], ".", ms=3, label="prefill tokens")
    ax.plot(
        times,
        [it.decode_seqs for it in iterations],
        ".",
        ms=3,
        label="decode tokens (1 per decoding sequence)",
    )
    _mark_swaps(ax, swaps, t0)
    label_axes(
        ax,
        "time since first line (s)",
        "tokens in the iteration",
        "Per-iteration prefill vs decode tokens (dashed: policy swaps)",
    )
    return save(fig, path)


def plot_step_and_kv(
    iterations: Sequence[Iteration], swaps: Sequence[Swap], t0: float, path: Path
) -> Path:
    """Worker step time and KV cache usage over time."""
    fig = Figure(figsize=(10, 6))
    step_ax, kv_ax = fig.subplots(2, 1, sharex=True)
    times = [it.ts - t0 for it in iterations]
    step_ax.plot(times, [it.step_ms for it in iterations], ".", ms=3, label="step ms (worker)")
    schedule = [
        (t, it.schedule_ms)
        for t, it in zip(times, iterations, strict=True)
        if it.schedule_ms is not None
    ]
    if schedule:
        step_ax.plot(*zip(*schedule, strict=True), ".", ms=3, label="schedule ms (service)")
    step_ax.set_ylabel("ms")
    step_ax.legend(fontsize=8)
    kv_ax.plot(
        times, [100 * it.kv_blocks_used / max(it.kv_blocks_total, 1) for it in iterations], lw=1
    )
    kv_ax.set_ylabel("KV blocks used (%)")
    kv_ax.set_xlabel("time since first line (s)")
    for ax in (step_ax, kv_ax):
        _mark_swaps(ax, swaps, t0)
        ax.grid(alpha=0.3)
    step_ax.set_title("Step time and KV cache usage")
    return save(fig, path)


def _cdf(ax: Axes, values: list[float], label: str) -> None:
    ordered = sorted(values)
    ax.step(
        ordered,
        [(i + 1) / len(ordered) for i in range(len(ordered))],
        where="post",
        label=f"{label} (n={len(ordered)})",
    )


def plot_request_cdfs(
    requests: Sequence[FinishedRequest],
    group_of: Callable[[FinishedRequest], str],
    title: str,
    path: Path,
) -> Path:
    """CDFs of TTFT and of each request's p99 and max ITL, one line per group."""
    fig = Figure(figsize=(13, 4.2))
    axes = fig.subplots(1, 3)
    measures = (
        ("TTFT ms", "ttft_ms"),
        ("per-request ITL p99 ms", "itl_p99_ms"),
        ("per-request ITL max ms", "itl_max_ms"),
    )
    groups = sorted({group_of(r) for r in requests})
    for ax, (label, attr) in zip(axes, measures, strict=True):
        for group in groups:
            values = [
                v for r in requests if group_of(r) == group and (v := getattr(r, attr)) is not None
            ]
            if values:
                _cdf(ax, values, group)
        label_axes(ax, label, "fraction of requests", legend=7)
    fig.suptitle(title)
    return save(fig, path)
