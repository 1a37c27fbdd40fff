"""/metrics on a real server: Prometheus text that parses, with vLLM-style names, and moves."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixtures import RunningServer

pytestmark = pytest.mark.real_model
REQUIRED = [
    "cadence:time_to_first_token_seconds",
    "cadence:inter_token_latency_seconds",
    "cadence:e2e_request_latency_seconds",
    "cadence:request_queue_time_seconds",
    "cadence:num_requests_running",
    "cadence:num_requests_waiting",
    "cadence:kv_cache_usage_perc",
    "cadence:prompt_tokens",
    "cadence:generation_tokens",
    "cadence:num_preemptions",
    "cadence:request_preemptions",
    "cadence:policy_swaps",
    "cadence:iteration_tokens",
    "cadence:worker_idle_seconds",
    "cadence:request_success",
    "cadence:cache_config_info",
]


def scrape(server: RunningServer) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    families = set()
    for family in text_string_to_metric_families(response.text):
        families.add(family.name)
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    missing = [name for name in REQUIRED if name not in families]
    assert not missing, f"missing metric families {missing}"
    return samples


def test_metrics_parse_and_move_with_requests(cadence_server: RunningServer) -> None:
    before = scrape(cadence_server)
    body = {
        "prompt": "Say something.",
        "max_tokens": 7,
        "ignore_eos": True,
        "model": cadence_server.model,
    }
    response = httpx.post(f"{cadence_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    after = scrape(cadence_server)

    def delta(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("cadence:generation_tokens_total") == 7
    assert delta("cadence:prompt_tokens_total") == prompt_tokens
    assert delta("cadence:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("cadence:time_to_first_token_seconds_count") == 1
    assert delta("cadence:e2e_request_latency_seconds_count") == 1
    assert delta("cadence:request_preemptions_count") == 1
    assert delta("cadence:request_preemptions_bucket", (("le", "0.0"),)) == 1  # never preempted
    assert delta("cadence:inter_token_latency_seconds_count") == 6
    assert delta("cadence:iteration_tokens_count") >= 7
    assert delta("cadence:worker_idle_seconds_count") >= 6  # each step but the first
    buckets = [
        le
        for (name, labels) in after
        if name == "cadence:time_to_first_token_seconds_bucket"
        for key, le in labels
        if key == "le"
    ]
    assert "0.001" in buckets and any(float(b) >= 60 for b in buckets if b != "+Inf")
    assert after[("cadence:kv_cache_usage_perc", ())] == 0.0  # idle again
    idle = cadence_server.admin_state()
    assert (idle["admission_paused"], idle["kv_blocks_promised"]) == (False, 0)
    state = idle["kv_cache"]
    config = [labels for (name, labels) in after if name == "cadence:cache_config_info"]
    assert config == [
        (
            ("block_size", "16"),
            ("cache_dtype", "float32"),
            ("num_gpu_blocks", str(state["num_blocks"])),
        )
    ]
