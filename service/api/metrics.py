"""Prometheus metrics (vLLM's names where they exist, prefix "cadence:"), fed as an Observer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from service.engine.stats import IterationStats, RequestEvent, RequestStats
from service.logging import log_lines_dropped

CONTENT_TYPE = CONTENT_TYPE_LATEST
# 1 ms .. 2 min: ITL lives at the low end, TTFT of a long prompt under load at the high end.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    60.0,
    120.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# a storm shows as finished requests piling up at --max-preemptions (default 3)
COUNT_BUCKETS = (0, 1, 2, 3, 5, 10, 20)
# 0.1 ms .. 1 s (the worker reports no longer gap); overlap keeps it near the bottom.
GAP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
BUCKETS = {
    "latency": LATENCY_BUCKETS,
    "tokens": TOKEN_BUCKETS,
    "count": COUNT_BUCKETS,
    "gap": GAP_BUCKETS,
}


# (attribute, kind, name after "cadence:", help); histograms take their buckets by kind
# fmt: off
_DEFINITIONS = [
    ("ttft", "latency", "time_to_first_token_seconds",
     "Time from request received to its first token."),
    ("itl", "latency", "inter_token_latency_seconds",
     "Gap between consecutive output tokens of one request."),
    ("tpot", "latency", "time_per_output_token_seconds",
     "Mean time per output token after the first, per request."),
    ("e2e", "latency", "e2e_request_latency_seconds",
     "Time from request received to finished."),
    ("queue_time", "latency", "request_queue_time_seconds",
     "Time from request received to first scheduled."),
    ("iteration_tokens", "tokens", "iteration_tokens",
     "Tokens computed per engine iteration."),
    ("step_seconds", "latency", "iteration_step_seconds",
     "Worker time of one iteration (forward + sample)."),
    ("worker_idle", "gap", "worker_idle_seconds",
     "Time the worker waited for a plan after sending its previous result."),
    ("running", "gauge", "num_requests_running",
     "Requests admitted and holding KV blocks."),
    ("waiting", "gauge", "num_requests_waiting",
     "Requests waiting for admission."),
    ("kv_usage", "gauge", "kv_cache_usage_perc",
     "Fraction of KV cache blocks in use (0..1)."),
    ("prefix_cache_blocks", "gauge", "prefix_cache_blocks",
     "KV blocks registered in the prefix cache, in use or evictable."),
    ("prompt_tokens", "counter", "prompt_tokens_total",
     "Prompt tokens of finished requests."),
    ("generation_tokens", "counter", "generation_tokens_total",
     "Generated tokens of finished requests."),
    ("preemptions", "counter", "num_preemptions_total",
     "Sequences preempted (KV freed, recomputed later)."),
    ("request_preemptions", "count", "request_preemptions",
     "Times each finished request was preempted."),
    ("policy_swaps", "counter", "policy_swaps_total",
     "Scheduling policy hot swaps."),
    ("received", "counter", "request_received_total",
     "Requests accepted by the engine."),
    ("refused", "counter", "request_refused_total",
     "Load shed: refused at arrival (queue full, queued tokens, predicted TTFT, deadline) "
     "or not started by its deadline."),
    ("finished", "counter", "request_success_total",
     "Finished requests by finish reason."),
    ("lora_requests", "counter", "lora_requests_total",
     "Finished requests of each LoRA adapter (the base model's are not counted)."),
    ("lora_generation_tokens", "counter", "lora_generation_tokens_total",
     "Generated tokens of each LoRA adapter's finished requests."),
    ("tenant_waiting", "gauge", "tenant_requests_waiting",
     "Sequences waiting, by API key tenant."),
    ("tenant_kv_blocks", "gauge", "tenant_kv_blocks_reserved",
     "KV blocks a tenant's live sequences may come to hold (prompt + max_tokens), by key tenant."),
    ("spec_drafts", "counter", "spec_decode_num_drafts",
     "Speculative decoding: sequence-steps that verified drafted tokens, as vLLM's."),
    ("spec_draft_tokens", "counter", "spec_decode_num_draft_tokens",
     "Speculative decoding: drafted tokens verified."),
    ("spec_accepted_tokens", "counter", "spec_decode_num_accepted_tokens",
     "Speculative decoding: drafted tokens the worker accepted."),
    ("spec_acceptance", "gauge", "spec_decode_draft_acceptance_rate",
     "Speculative decoding: accepted / drafted tokens since the start."),
    ("spans_dropped", "counter", "otlp_spans_dropped_total",
     "Trace spans dropped: the export queue was full, or the collector did not take them."),
    ("policy", "gauge", "policy_info",
     "The scheduling policy in force (value 1)."),
    ("cache_config", "gauge", "cache_config_info",
     "The worker's KV cache: block size, blocks and dtype (value 1), as vLLM's."),
]
# fmt: on
_LABELS = {
    "finished": ("finished_reason",),
    # the adapters an operator registered (--lora-modules, the admin routes): a bounded set
    "lora_requests": ("adapter",),
    "lora_generation_tokens": ("adapter",),
    "refused": ("reason",),
    "tenant_waiting": ("tenant",),
    "tenant_kv_blocks": ("tenant",),
    "policy": ("policy",),
    "cache_config": ("block_size", "num_gpu_blocks", "cache_dtype"),
}


def _metric(
    kind: str, name: str, doc: str, labels: tuple[str, ...], registry: CollectorRegistry
) -> Histogram | Gauge | Counter:
    full_name = f"cadence:{name}"
    if kind in BUCKETS:
        return Histogram(full_name, doc, labels, buckets=BUCKETS[kind], registry=registry)
    cls = Gauge if kind == "gauge" else Counter
    return cls(full_name, doc, labels, registry=registry)


class _CountersReadAtScrape(Collector):
    """Counters kept elsewhere (the engine, the log sink), read when /metrics is scraped."""

    def __init__(self) -> None:
        self.values = {
            "worker_restarts": 0.0,
            "log_lines_dropped": 0.0,
            "prefix_cache_queries": 0.0,
            "prefix_cache_hits": 0.0,
        }
        self.kv_holds: dict[str, float] = {}  # a producer's (--kv-transfer-role), by outcome
        self.kv_staging: dict[str, float] = {}  # its prompts staged or not (no room), by outcome

    def collect(self) -> Iterator[CounterMetricFamily]:
        # vLLM's names: tokens of the prompts admitted, and of those the ones found cached
        yield CounterMetricFamily(
            "cadence:prefix_cache_queries",
            "Prefix cache queries, in tokens (those of each sequence admitted).",
            value=self.values["prefix_cache_queries"],
        )
        yield CounterMetricFamily(
            "cadence:prefix_cache_hits",
            "Prefix cache hits, in tokens (found cached, not computed).",
            value=self.values["prefix_cache_hits"],
        )
        yield CounterMetricFamily(
            "cadence:worker_restarts",
            "Workers started again after one died or hung.",
            value=self.values["worker_restarts"],
        )
        if self.kv_holds:
            yield _by_outcome(
                "cadence:kv_transfer_holds",
                "A producer's prompt K/V held for consumers: held, then released by the "
                "consumer's notice or expired at --kv-hold-timeout.",
                self.kv_holds,
            )
        if self.kv_staging:
            yield _by_outcome(
                "cadence:kv_transfer_staging",
                "A producer's held prompts gathered into its staging arena (staged), or held "
                "unstaged for want of room (--kv-staging-tokens).",
                self.kv_staging,
            )
        yield CounterMetricFamily(
            "cadence:log_lines_dropped",
            "Log lines dropped because the log's reader fell behind.",
            value=self.values["log_lines_dropped"],
        )


def _by_outcome(name: str, documentation: str, counts: dict[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["outcome"])
    for outcome, value in counts.items():
        family.add_metric([outcome], value)
    return family


class Metrics:
    """One registry per app (never the process-global one), updated by the engine's events."""

    def __init__(self, tenants: frozenset[str] = frozenset()) -> None:
        """`tenants`: the API keys' tenants, the only tenant labels (clients name others)."""
        self.tenants = tenants
        self.registry = CollectorRegistry()
        for attribute, kind, name, doc in _DEFINITIONS:
            labels = _LABELS.get(attribute, ())
            setattr(self, attribute, _metric(kind, name, doc, labels, self.registry))
        self._read_at_scrape = _CountersReadAtScrape()
        self.registry.register(self._read_at_scrape)
        self._drafted = self._accepted = 0  # the acceptance rate's terms

    def __getattr__(self, attribute: str) -> Any:
        """The table's metrics, set as attributes in __init__ (this tells a type checker)."""
        raise AttributeError(attribute)

    # --- service.engine.stats.Observer -------------------------------------------------------
    def on_request_received(self, request_id: str, tenant: str, prompt_tokens: int) -> None:
        self.received.inc()

    def on_iteration(self, stats: IterationStats) -> None:
        self.iteration_tokens.observe(stats.batch_tokens)
        self.step_seconds.observe(stats.step_ms / 1000.0)
        if stats.worker_idle_ms is not None:
            self.worker_idle.observe(stats.worker_idle_ms / 1000.0)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        if stats.kv_blocks_total:
            self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total)
        if stats.draft_tokens:
            self._on_drafts(stats)

    def _on_drafts(self, stats: IterationStats) -> None:
        self.spec_drafts.inc(stats.drafting_seqs)
        self.spec_draft_tokens.inc(stats.draft_tokens)
        self.spec_accepted_tokens.inc(stats.accepted_tokens)
        self._drafted += stats.draft_tokens
        self._accepted += stats.accepted_tokens
        self.spec_acceptance.set(self._accepted / self._drafted)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.finished.labels(finished_reason=stats.finish_reason).inc()
        if stats.adapter is not None:
            self.lora_requests.labels(adapter=stats.adapter).inc()
            self.lora_generation_tokens.labels(adapter=stats.adapter).inc(stats.completion_tokens)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        self.e2e.observe(stats.e2e)
        self.request_preemptions.observe(stats.preemptions)
        for value, histogram in (
            (stats.ttft, self.ttft),
            (stats.queue_time, self.queue_time),
            (stats.tpot, self.tpot),
        ):
            if value is not None:
                histogram.observe(value)
        for gap in stats.itls:
            self.itl.observe(gap)

    def on_preemption(self, request_id: str) -> None:
        self.preemptions.inc()

    def on_request_refused(self, reason: str) -> None:
        self.refused.labels(reason=reason).inc()

    def on_request_event(self, event: RequestEvent) -> None:
        """The story's milestones are counted where they have their own hooks."""

    def on_policy_swap(self, old: str, new: str, iteration: int) -> None:
        self.policy_swaps.inc()
        self.policy.labels(policy=old).set(0)
        self.policy.labels(policy=new).set(1)

    # --- exposition -----------------------------------------------------------------
    def render(self, engine_state: dict[str, Any]) -> bytes:
        """Text exposition; gauges are refreshed from the engine first (it may be idle)."""
        self.running.set(engine_state.get("running", 0))
        self.waiting.set(engine_state.get("waiting", 0))
        total = engine_state.get("kv_blocks_total") or 0
        if total:
            self.kv_usage.set(engine_state.get("kv_blocks_used", 0) / total)
        policy = engine_state.get("policy")
        name = policy.get("name") if isinstance(policy, dict) else policy
        if name:
            self.policy.labels(policy=name).set(1)
        cache = engine_state.get("kv_cache")
        if cache:
            # One series: a restarted worker's cache may differ from its predecessor's.
            self.cache_config.clear()
            labels = (str(cache["block_size"]), str(cache["num_blocks"]), cache["dtype"])
            self.cache_config.labels(*labels).set(1)
        self._read_at_scrape.values["worker_restarts"] = engine_state.get("worker_restarts", 0)
        prefix = engine_state.get("prefix_cache") or {}
        self.prefix_cache_blocks.set(prefix.get("cached_blocks", 0))
        self._read_at_scrape.values["prefix_cache_queries"] = prefix.get("queries_tokens", 0)
        self._read_at_scrape.values["prefix_cache_hits"] = prefix.get("hits_tokens", 0)
        self._read_at_scrape.values["log_lines_dropped"] = log_lines_dropped()
        transfer = engine_state.get("kv_transfer") or {}
        holds, staging = transfer.get("holds") or {}, transfer.get("staging") or {}
        outcomes = ("held", "released", "expired")
        self._read_at_scrape.kv_holds = {o: float(holds[o]) for o in outcomes if o in holds}
        staged = ("staged", "unstaged")
        self._read_at_scrape.kv_staging = {o: float(staging[o]) for o in staged if o in staging}
        self._render_tenants(engine_state.get("tenants") or {})
        return generate_latest(self.registry)

    def _render_tenants(self, loads: dict[str, Any]) -> None:
        for tenant in self.tenants:
            load = loads.get(tenant)
            self.tenant_waiting.labels(tenant=tenant).set(load.waiting if load else 0)
            self.tenant_kv_blocks.labels(tenant=tenant).set(load.kv_blocks if load else 0)
