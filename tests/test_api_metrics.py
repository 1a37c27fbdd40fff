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


def test_a_producers_holds_and_staging_are_counted_by_outcome():
    metrics = Metrics()
    holds = {"holding": 1, "held": 4, "released": 3, "expired": 0}
    staging = {"blocks": 8, "used": 2, "staged": 3, "unstaged": 1}
    metrics.render({"kv_transfer": {"role": "producer", "holds": holds, "staging": staging}})

    def sample(name: str, outcome: str) -> float | None:
        return metrics.registry.get_sample_value(f"cadence:{name}_total", {"outcome": outcome})

    assert [sample("kv_transfer_holds", o) for o in ("held", "released", "expired")] == [4, 3, 0]
    assert [sample("kv_transfer_staging", o) for o in ("staged", "unstaged")] == [3, 1]
