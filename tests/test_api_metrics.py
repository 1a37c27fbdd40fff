"""The Prometheus metrics fed directly, as the engine's observer, without a server."""

from __future__ import annotations

from service.api.metrics import Metrics
from service.engine.stats import RequestStats


def finished(preemptions: int) -> RequestStats:
    return RequestStats(
        request_id="r",
        tenant="t",
        policy="stall_free",
        finish_reason="length",
        finish_detail="max_tokens",
        prompt_tokens=4,
        completion_tokens=2,
        received=0.0,
        first_scheduled=0.1,
        first_token=0.2,
        finished=0.3,
        token_times=(0.2, 0.3),
        preemptions=preemptions,
        iteration=5,
    )


def test_preemptions_per_finished_request_make_a_histogram():
    metrics = Metrics()
    for preemptions in (0, 0, 1, 3, 3):
        metrics.on_request_finished(finished(preemptions))

    def sample(suffix: str, **labels: str) -> float | None:
        name = f"cadence:request_preemptions_{suffix}"
        return metrics.registry.get_sample_value(name, labels)

    assert (sample("count"), sample("sum")) == (5, 7)
    assert [sample("bucket", le=le) for le in ("0.0", "1.0", "2.0", "3.0")] == [2, 3, 3, 5]
    assert b"cadence:request_preemptions_bucket" in metrics.render({})
