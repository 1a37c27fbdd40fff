import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ops.client import RequestRecord
from ops.summary import (
    SLO,
    distribution,
    format_table,
    interference_windows,
    meets_slo,
    percentile,
    summarize,
    summary_table,
    tpot,
)


def record(index, send, chunks, role="request", tokens=None, error=None, end=None, prompt_len=10):
    return RequestRecord(
        index=index,
        role=role,
        tenant=None,
        arrival_s=send,
        prompt_len=prompt_len,
        max_tokens=len(chunks),
        send_s=send,
        first_token_s=chunks[0] if chunks else None,
        end_s=end if end is not None else (chunks[-1] if chunks else send + 1),
        chunk_times=list(chunks),
        completion_tokens=tokens,
        error=error,
    )


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-9, abs=1e-6)


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert distribution([]) == {
        "n": 0,
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
    }


def test_summary_numbers_by_hand():
    a = record(0, 0.0, [0.5, 0.6, 0.7, 1.0])  # ttft 500, gaps 100 100 300
    b = record(1, 0.0, [1.0, 1.1], tokens=2)  # ttft 1000, gap 100
    bad = record(2, 0.5, [], error="HTTP 500: boom", end=0.6)
    s = summarize([a, b, bad], SLO(ttft_ms=800, itl_p99_ms=250))
    assert (s["requests"], s["succeeded"], s["failed"]) == (3, 2, 1)
    assert s["duration_s"] == pytest.approx(1.1)
    assert s["output_tokens"] == 6
    assert s["output_tokens_per_s"] == pytest.approx(6 / 1.1)
    assert s["requests_per_s"] == pytest.approx(2 / 1.1)
    assert s["ttft_ms"]["p50"] == pytest.approx(750) and s["ttft_ms"]["max"] == pytest.approx(1000)
    assert s["itl_ms"]["n"] == 4 and s["itl_ms"]["max"] == pytest.approx(300)
    assert s["itl_ms"]["p50"] == pytest.approx(100)
    # a misses the ITL target (its own p99 gap ~296 ms), b misses TTFT: nobody is good
    assert s["goodput_requests"] == 0
    assert summarize([a, b], SLO(ttft_ms=1200, itl_p99_ms=400))["goodput_requests"] == 2
    assert summarize([a, b], SLO())["goodput_requests_per_s"] is None
    assert s["errors"] == ["HTTP 500: boom"]


def test_tpot_uses_token_count_from_usage():
    assert tpot(record(0, 0, [1.0, 2.0], tokens=5)) == pytest.approx(0.25)
    assert tpot(record(0, 0, [1.0, 2.0, 3.0])) == pytest.approx(1.0)
    assert tpot(record(0, 0, [1.0])) is None


def test_slo_failed_request_never_counts():
    assert not meets_slo(record(0, 0, [0.1], error="x"), SLO(ttft_ms=1e9))
    assert meets_slo(record(0, 0, [0.1, 0.2]), SLO(ttft_ms=150))
    assert not meets_slo(record(0, 0, [0.2, 0.3]), SLO(ttft_ms=150))


def test_interference_window_takes_gaps_overlapping_the_prefill():
    decoder = record(0, 0.0, [0.1, 0.2, 0.3, 1.3, 1.4, 1.5], role="decoder")
    idle = record(1, 0.0, [0.1, 0.2], role="decoder")  # finished before the injection
    injected = record(2, 0.25, [1.3], role="injected", prompt_len=4096)
    injected.arrival_s = 0.25
    (window,) = interference_windows([decoder, idle, injected])
    assert window["prompt_len"] == 4096 and window["decoders_active"] == 1
    assert window["injected_ttft_ms"] == pytest.approx(1050)
    # gaps overlapping [0.25, 1.3]: 0.2->0.3 and 0.3->1.3
    assert window["decoder_itl_ms"]["n"] == 2
    assert window["decoder_itl_ms"]["max"] == pytest.approx(1000)


def test_tables_render_values_and_dashes():
    text = format_table(["a", "b"], [["x", 1.25], ["yy", None]])
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b"] and lines[2].split() == ["x", "1.2"]
    assert lines[3].split() == ["yy", "-"]
    s = summarize([record(0, 0.0, [0.5, 0.6])], SLO(ttft_ms=100))
    table = summary_table(s)
    assert "TTFT <= 100 ms" in table and "ITL ms" in table and "500.0" in table
