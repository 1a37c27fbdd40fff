"""The numbers of a capacity sweep: SLO attainment per ITL target, the capacity, the tables.

A request meets a target when it succeeded, its TTFT is within the TTFT target and its own
p99 gap between chunks is within the ITL target (`ops.summary.meets_slo`). Attainment is the
share of a run's requests that meet it; goodput is how many met it per second of arrivals,
so at full attainment it equals the offered rate. The capacity is the highest rate run whose
attainment reaches the threshold with no failing rate below it: a pass above a failing rate
is noise, not capacity.

Everything here reads records or capacity.json's dictionaries, so finished sweeps (several,
merged) are reported again without a server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ops.client import RequestRecord
from ops.summary import SLO, distribution, format_table, itl_p99, meets_slo, summarize, to_ms


@dataclass(frozen=True, slots=True)
class Capacity:
    rate: float | None  # highest passing rate below every failing one; None: none passed
    lowest_failing: float | None  # None: every rate run passed
    below_lowest: bool  # the lowest rate run already failed
    at_least_highest: bool  # the highest rate run passed: the capacity may be higher


def capacity_of(attainment: Mapping[float, float], threshold: float) -> Capacity:
    """The capacity given each run rate's attainment of one target."""
    rates = sorted(attainment)
    lowest_failing = next((r for r in rates if attainment[r] < threshold), None)
    passing = [r for r in rates if lowest_failing is None or r < lowest_failing]
    rate = passing[-1] if passing else None
    return Capacity(rate, lowest_failing, rate is None, lowest_failing is None)


def bisection_rate(attainment: Mapping[float, float], threshold: float) -> float | None:
    """The midpoint between the capacity and the lowest failing rate (None without both)."""
    found = capacity_of(attainment, threshold)
    if found.rate is None or found.lowest_failing is None:
        return None
    return (found.rate + found.lowest_failing) / 2


def target_result(
    records: Sequence[RequestRecord], duration_s: float, slo: SLO
) -> dict[str, float | int | None]:
    met = sum(meets_slo(r, slo) for r in records)
    return {
        "itl_p99_ms": slo.itl_p99_ms,
        "met": met,
        "attainment": met / len(records),
        "goodput_requests_per_s": met / duration_s,
    }


def rate_result(
    records: Sequence[RequestRecord],
    rate: float,
    duration_s: float,
    ttft_ms: float,
    itl_targets: Sequence[float],
) -> dict[str, Any]:
    """One run's numbers: the usual summary, per-request p99 ITLs and each target's results."""
    own_p99s = (p for r in records if r.ok and (p := itl_p99(r)) is not None)
    return {
        "rate": rate,
        "summary": summarize(records, SLO()),
        "request_itl_p99_ms": distribution(to_ms(own_p99s)),
        "targets": [target_result(records, duration_s, SLO(ttft_ms, t)) for t in itl_targets],
    }


def attainments(runs: Sequence[Mapping[str, Any]], itl_p99_ms: float) -> dict[float, float]:
    """Rate -> attainment of one ITL target, from rate_result dictionaries."""
    return {
        run["rate"]: target["attainment"]
        for run in runs
        for target in run["targets"]
        if target["itl_p99_ms"] == itl_p99_ms
    }


def _percent(value: float) -> str:
    return f"{value:.0%}"


def rates_table(sweep: Mapping[str, Any]) -> str:
    targets = sweep["slo"]["itl_p99_ms"]
    headers = ["rate req/s", "requests", "failed"]
    headers += [f"met@{t:g}" for t in targets] + [f"good/s@{t:g}" for t in targets]
    headers += ["TTFT p50", "TTFT p99", "ITL-p99 p50", "ITL-p99 p90", "out tok/s"]
    rows = []
    for run in sweep["runs"]:
        summary, own = run["summary"], run["request_itl_p99_ms"]
        rows.append(
            [
                f"{run['rate']:g}{'*' if run['bisection'] else ''}",
                summary["requests"],
                summary["failed"],
                *(_percent(t["attainment"]) for t in run["targets"]),
                *(t["goodput_requests_per_s"] for t in run["targets"]),
                summary["ttft_ms"]["p50"],
                summary["ttft_ms"]["p99"],
                own["p50"],
                own["p90"],
                summary["output_tokens_per_s"],
            ]
        )
    return format_table(headers, rows)


def capacity_text(found: Mapping[str, Any]) -> str:
    if found["below_lowest"]:
        return f"< {found['lowest_failing']:g}"
    if found["at_least_highest"]:
        return f">= {found['rate']:g}"
    return f"{found['rate']:g} ({found['lowest_failing']:g} fails)"


def capacity_table(sweeps: Sequence[Mapping[str, Any]]) -> str:
    """One row per ITL target, one column per sweep: the capacity in requests/s."""
    targets = sorted({t for sweep in sweeps for t in sweep["slo"]["itl_p99_ms"]})
    rows = []
    for target in targets:
        cells: list[str | None] = [f"{target:g} ms"]
        for sweep in sweeps:
            found = next((c for c in sweep["capacity"] if c["itl_p99_ms"] == target), None)
            cells.append(None if found is None else capacity_text(found))
        rows.append(cells)
    return format_table(["ITL p99 target", *(s["name"] for s in sweeps)], rows)


def sweep_heading(sweep: Mapping[str, Any]) -> str:
    slo = sweep["slo"]
    return (
        f"{sweep['name']}: {sweep['url']} (model {sweep['model']})\n"
        f"met@T: share of requests with TTFT <= {slo['ttft_ms']:g} ms and their own p99 ITL "
        f"<= T ms; capacity: {_percent(slo['attainment'])} met\n"
        "latencies in ms; ITL-p99: each request's own p99 gap between chunks"
    )


def rates_run_note(sweep: Mapping[str, Any]) -> str:
    rates = ", ".join(f"{run['rate']:g}{'*' if run['bisection'] else ''}" for run in sweep["runs"])
    if not any(run["bisection"] for run in sweep["runs"]):
        return f"rates run: {rates}"
    return f"rates run: {rates} (* bisection for the {sweep['slo']['bisect_target']:g} ms target)"


def report_text(sweeps: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for sweep in sweeps:
        parts += [sweep_heading(sweep), rates_table(sweep), rates_run_note(sweep)]
        errors = sorted({e for run in sweep["runs"] for e in run["summary"]["errors"]})[:10]
        if errors:
            parts.append("errors:\n" + "\n".join(f"  {e}" for e in errors))
    parts.append("capacity (requests/s)\n" + capacity_table(sweeps))
    return "\n\n".join(parts)
