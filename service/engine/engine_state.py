"""The parts of the engine's state (Engine.state(), which the admin API and /metrics read)
that describe one subject each: the worker's KV cache, the prefix cache, the fitted cost
of a step, and speculative decoding.
"""

from __future__ import annotations

import dataclasses

from gpu_worker.protocol import Handshake
from service.engine.speculation import SpeculativeConfig, Speculator
from service.engine.step import SchedulerStats
from service.engine.step_cost import StepCostModel


def kv_cache_state(handshake: Handshake | None) -> dict | None:
    """The worker's KV cache as it started: None before a worker has."""
    if handshake is None:
        return None
    return {
        "block_size": handshake.block_size,
        "num_blocks": handshake.num_blocks,
        "dtype": handshake.kv_cache_dtype,
    }


def step_cost_state(step_cost: StepCostModel) -> dict | None:
    """The fitted model of a step's time that policies and admission use, if fitted yet."""
    cost = step_cost.estimate()
    return None if cost is None else dataclasses.asdict(cost)


def prefix_cache_state(enabled: bool, stats: SchedulerStats) -> dict:
    """Cached and evictable blocks, and the hit rate in tokens since the start."""
    queries, hits = stats.prefix_queries, stats.prefix_hits
    return {
        "enabled": enabled,
        "cached_blocks": stats.kv_blocks_cached,
        "evictable_blocks": stats.kv_blocks_evictable,
        "queries_tokens": queries,
        "hits_tokens": hits,
        "hit_rate": hits / queries if queries else None,
        "evicted_blocks": stats.kv_blocks_evicted,
    }


def speculative_state(
    spec: SpeculativeConfig | None, speculator: Speculator | None, stats: SchedulerStats
) -> dict | None:
    """The speculative config, and its drafted and accepted tokens since the start."""
    if spec is None:
        return None
    drafted, accepted = stats.draft_tokens, stats.accepted_tokens
    decode_cost = None if speculator is None else speculator.decode_cost.estimate()
    return {
        "config": spec.describe(),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        # what prices a decode-only step's drafts (service.engine.speculation)
        "decode_step_cost": None if decode_cost is None else dataclasses.asdict(decode_cost),
    }
