"""The numbers of a benchmark run: percentiles, throughput, goodput, interference windows.

Conventions (the measures README.md and BENCHMARKS.md use), all on the client's clock:
TTFT = first token chunk - send; ITL = gap between two consecutive token chunks of one
request; TPOT = (last chunk - first chunk) / (output tokens - 1). Durations in the summary
are milliseconds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ops.client import RequestRecord

QUANTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float | None = None
    itl_p99_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.itl_p99_ms is not None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Iterable[float]) -> dict[str, float | int | None]:
    """n, mean, p50, p90, p99, max of the values (None when there are none)."""
    data = list(values)
    stats: dict[str, float | int | None] = {"n": len(data)}
    stats["mean"] = sum(data) / len(data) if data else None
    for q in QUANTILES:
        stats[f"p{q}"] = percentile(data, q)
    stats["max"] = max(data) if data else None
    return stats


def to_ms(seconds: Iterable[float]) -> list[float]:
    return [s * 1000.0 for s in seconds]


def gaps(record: RequestRecord) -> list[float]:
    times = record.chunk_times
    return [b - a for a, b in itertools.pairwise(times)]


def ttft(record: RequestRecord) -> float | None:
    if record.first_token_s is None or record.send_s is None:
        return None
    return record.first_token_s - record.send_s


def tpot(record: RequestRecord) -> float | None:
    if len(record.chunk_times) < 2 or record.output_tokens < 2:
        return None
    return (record.chunk_times[-1] - record.chunk_times[0]) / (record.output_tokens - 1)


def itl_p99(record: RequestRecord) -> float | None:
    """The request's own p99 gap between token chunks (None with fewer than two chunks)."""
    return percentile(gaps(record), 99)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """Both targets at once, as goodput requires; an unset target is always met."""
    if not record.ok:
        return False
    first = ttft(record)
    if slo.ttft_ms is not None and (first is None or first * 1000 > slo.ttft_ms):
        return False
    if slo.itl_p99_ms is not None:
        own_p99 = itl_p99(record)
        if own_p99 is not None and own_p99 * 1000 > slo.itl_p99_ms:
            return False
    return True


def run_span(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first send to the last end (0 when nothing was sent)."""
    sends = [r.send_s for r in records if r.send_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    return max(ends) - min(sends) if sends and ends else 0.0


def summarize(records: Sequence[RequestRecord], slo: SLO) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    duration = run_span(records)
    output_tokens = sum(r.output_tokens for r in ok)
    rate = (lambda count: count / duration) if duration > 0 else (lambda count: None)
    good = sum(meets_slo(r, slo) for r in records) if slo.given else None
    return {
        "requests": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "duration_s": duration,
        "output_tokens": output_tokens,
        "output_tokens_per_s": rate(output_tokens),
        "requests_per_s": rate(len(ok)),
        "goodput_requests": good,
        "goodput_requests_per_s": None if good is None else rate(good),
        "slo": {"ttft_ms": slo.ttft_ms, "itl_p99_ms": slo.itl_p99_ms},
        "ttft_ms": distribution(to_ms(t for r in ok if (t := ttft(r)) is not None)),
        "itl_ms": distribution(to_ms(g for r in ok for g in gaps(r))),
        "tpot_ms": distribution(to_ms(t for r in ok if (t := tpot(r)) is not None)),
        "e2e_ms": distribution(to_ms(r.end_s - r.send_s for r in ok)),
    }


def summarize_groups(records: Sequence[RequestRecord], slo: SLO) -> dict[str, dict[str, Any]]:
    """One summary per tenant (or per role when no tenant is set)."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(record.tenant or record.role, []).append(record)
    return {name: summarize(group, slo) for name, group in sorted(groups.items())}


def gaps_overlapping(record: RequestRecord, start: float, end: float) -> list[float]:
    """Token gaps of `record` that overlap the interval [start, end]."""
    times = record.chunk_times
    return [b - a for a, b in itertools.pairwise(times) if b > start and a < end]


def interference_windows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """For each injected prompt: its TTFT and the decoders' gaps while it was prefilled.

    The window runs from the injection's send to its first token (to its end when it got
    none): the time in which its prompt was being computed alongside the decoders.
    """
    decoders = [r for r in records if r.role == "decoder"]
    windows = []
    for injected in (r for r in records if r.role == "injected"):
        start = injected.send_s if injected.send_s is not None else injected.arrival_s
        end = injected.first_token_s if injected.first_token_s is not None else injected.end_s
        window_gaps: list[float] = []
        active = 0
        for decoder in decoders:
            found = gaps_overlapping(decoder, start, end if end is not None else start)
            active += bool(found)
            window_gaps.extend(found)
        first = ttft(injected)
        windows.append(
            {
                "prompt_len": injected.prompt_len,
                "prompt_tokens": injected.prompt_tokens,
                "at_s": injected.arrival_s,
                "window_s": [start, end],
                "injected_ttft_ms": None if first is None else first * 1000,
                "injected_error": injected.error,
                "decoders_active": active,
                "decoder_itl_ms": distribution(to_ms(window_gaps)),
            }
        )
    return windows


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        # small rates (0.04 requests/s) would read as 0.0 with one decimal
        return f"{value:.3f}" if 0 < abs(value) < 1 else f"{value:,.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain monospace table; floats with one decimal, None as '-'."""
    cells = [list(headers)] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_table(summary: dict[str, Any]) -> str:
    slo = summary["slo"]
    slo_text = ", ".join(
        f"{name} <= {value:g} ms"
        for name, value in (("TTFT", slo["ttft_ms"]), ("ITL p99", slo["itl_p99_ms"]))
        if value is not None
    )
    head = [
        ("requests (ok / failed)", f"{summary['succeeded']} / {summary['failed']}"),
        ("duration s", summary["duration_s"]),
        ("output tokens", summary["output_tokens"]),
        ("output tokens/s", summary["output_tokens_per_s"]),
        ("requests/s", summary["requests_per_s"]),
        (f"goodput req/s ({slo_text or 'no SLO given'})", summary["goodput_requests_per_s"]),
    ]
    dists = [
        [label, *(summary[key][f"p{q}"] for q in QUANTILES), summary[key]["max"], summary[key]["n"]]
        for label, key in (
            ("TTFT ms", "ttft_ms"),
            ("ITL ms", "itl_ms"),
            ("TPOT ms", "tpot_ms"),
            ("E2E ms", "e2e_ms"),
        )
    ]
    return "\n\n".join(
        [
            format_table(["measure", "value"], head),
            format_table(["latency", "p50", "p90", "p99", "max", "n"], dists),
        ]
    )


def interference_table(windows: Sequence[dict[str, Any]]) -> str:
    rows = [
        [
            w["prompt_len"],
            f"{w['at_s']:g}",
            w["injected_ttft_ms"],
            w["decoders_active"],
            w["decoder_itl_ms"]["p99"],
            w["decoder_itl_ms"]["max"],
        ]
        for w in windows
    ]
    headers = [
        "injected tokens",
        "at s",
        "its TTFT ms",
        "decoders",
        "decoder ITL p99 ms",
        "decoder ITL max ms",
    ]
    return format_table(headers, rows)


def groups_table(groups: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            s["succeeded"],
            s["output_tokens"],
            s["ttft_ms"]["p50"],
            s["ttft_ms"]["p99"],
            s["itl_ms"]["p50"],
            s["itl_ms"]["p99"],
            s["itl_ms"]["max"],
        ]
        for name, s in groups.items()
    ]
    headers = ["group", "ok", "out tokens", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max"]
    return format_table(headers, rows)
