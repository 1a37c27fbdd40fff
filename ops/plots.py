"""PNG plots of a benchmark run (matplotlib figures rendered by Agg, no pyplot state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from ops.client import RequestRecord
from ops.figures import label_axes, save
from ops.summary import gaps

MAX_GAP_SERIES = 24  # more lines than this make the gap plot unreadable


def _gap_series(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    decoders = [r for r in records if r.role == "decoder" and len(r.chunk_times) > 1]
    chosen = decoders or [r for r in records if len(r.chunk_times) > 1]
    return chosen[:MAX_GAP_SERIES]


def plot_token_gaps(records: Sequence[RequestRecord], path: Path) -> Path:
    """Each (decoding) request's gap before every token, over run time; injections marked."""
    fig = Figure(figsize=(10, 5))
    ax = fig.add_subplot()
    for record in _gap_series(records):
        ax.plot(
            record.chunk_times[1:],
            [g * 1000 for g in gaps(record)],
            lw=0.8,
            marker=".",
            ms=2,
            label=f"#{record.index}",
        )
    for injected in (r for r in records if r.role == "injected"):
        at = injected.send_s if injected.send_s is not None else injected.arrival_s
        ax.axvline(at, color="red", ls="--", lw=1)
        ax.annotate(
            f"{injected.prompt_len} tok",
            (at, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            va="top",
            ha="left",
            color="red",
            fontsize=8,
        )
        if injected.first_token_s is not None:
            ax.axvspan(at, injected.first_token_s, color="red", alpha=0.08)
    label_axes(
        ax,
        "time since start (s)",
        "gap before token (ms)",
        "Token gaps of decoding requests (red: injected prompt until its first token)",
        legend=None,
    )
    return save(fig, path)


def plot_itl_cdf(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> Path:
    """Empirical CDF of inter-token gaps, one line per run."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for label, records in runs.items():
        values = sorted(g * 1000 for r in records if r.ok for g in gaps(r))
        if values:
            ax.step(
                values,
                [(i + 1) / len(values) for i in range(len(values))],
                where="post",
                label=f"{label} (n={len(values)})",
            )
    ax.set_xscale("log")
    label_axes(ax, "ITL (ms, log scale)", "fraction of gaps <= x", "ITL distribution")
    return save(fig, path)


def plot_ttft_by_prompt_len(records: Sequence[RequestRecord], path: Path) -> Path:
    """TTFT of every successful request against its prompt length, coloured by role."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for role in sorted({r.role for r in records}):
        points = [
            (r.prompt_len, (r.first_token_s - r.send_s) * 1000)
            for r in records
            if r.role == role and r.ok and r.send_s is not None
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, s=14, label=role)
    label_axes(ax, "prompt length (tokens)", "TTFT (ms)", "Time to first token by prompt length")
    return save(fig, path)


def write_bench_plots(records: Sequence[RequestRecord], out_dir: Path, label: str) -> list[Path]:
    return [
        plot_token_gaps(records, out_dir / "token_gaps.png"),
        plot_itl_cdf({label: records}, out_dir / "itl_cdf.png"),
        plot_ttft_by_prompt_len(records, out_dir / "ttft_by_prompt_len.png"),
    ]


LINE_STYLES = ("-", "--", ":", "-.")


def plot_attainment(
    curves: Mapping[str, Mapping[float, Mapping[float, float]]],
    thresholds: Sequence[float],
    path: Path,
) -> Path:
    """SLO attainment against request rate: a colour per sweep, a line style per ITL target.

    `curves`: sweep name -> ITL target (ms) -> rate -> attainment (0..1).
    """
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    rates: set[float] = set()
    for colour, (name, by_target) in enumerate(curves.items()):
        for style, (target, points) in enumerate(sorted(by_target.items())):
            xs = sorted(points)
            rates.update(xs)
            ax.plot(
                xs,
                [points[x] * 100 for x in xs],
                color=f"C{colour % 10}",
                ls=LINE_STYLES[style % len(LINE_STYLES)],
                marker="o",
                ms=4,
                label=f"{name}, ITL p99 <= {target:g} ms",
            )
    for threshold in sorted(set(thresholds)):
        ax.axhline(threshold * 100, color="grey", lw=1, label=f"{threshold:.0%} of requests")
    ax.set_xscale("log")
    ax.set_xticks(sorted(rates), [f"{r:g}" for r in sorted(rates)])
    ax.minorticks_off()
    ax.set_ylim(-2, 102)
    label_axes(
        ax,
        "request rate (requests/s, log scale)",
        "requests meeting TTFT and ITL targets (%)",
        "SLO attainment by request rate",
    )
    return save(fig, path)
