"""Each policy alone, on hand-built views: what it schedules and why."""

from __future__ import annotations

import dataclasses

import pytest

from policies.base import PolicyError, StepCost
from policies.registry import POLICIES, describe_policies, make_policy
from tests.policy_views import seq, view

DECODING = [seq(i, 20, generated=3) for i in range(4)]


def test_registry_names_and_errors():
    assert sorted(POLICIES) == ["fair", "fcfs", "priority", "slo", "stall_free"]
    described = {d["name"]: d for d in describe_policies()}
    assert described["stall_free"]["params"]["token_budget"] == 512
    assert all(d["summary"] for d in described.values())
    with pytest.raises(PolicyError, match="unknown policy"):
        make_policy("lifo", {})
    with pytest.raises(PolicyError, match="unknown parameter"):
        make_policy("fcfs", {"chunk": 3})
    with pytest.raises(PolicyError, match=">= 1"):
        make_policy("stall_free", {"chunk_size": 0})
    with pytest.raises(PolicyError, match="must be"):
        make_policy("fair", {"weights": {"a": -1}})
    with pytest.raises(PolicyError, match="true or false"):
        make_policy("priority", {"preempt": "maybe"})


def test_fcfs_runs_the_whole_prompt_and_stalls_decodes():
    policy = make_policy("fcfs", {})
    d = policy.decide(view(DECODING, [seq(10, 400), seq(11, 50)], cap=8192))
    assert d.schedule == [(10, 400), (11, 50)]  # prefill only: decodes wait this step
    d = policy.decide(view(DECODING))
    assert d.schedule == [(i, 1) for i in range(4)]


def test_fcfs_keeps_arrival_order_and_splits_only_an_overlong_prompt():
    policy = make_policy("fcfs", {})
    d = policy.decide(view([], [seq(10, 300), seq(11, 300)], cap=512))
    assert d.schedule == [(10, 300)]  # the second waits for its own step
    d = policy.decide(view([], [seq(12, 2000)], cap=512))
    assert d.schedule == [(12, 512)]


def test_stall_free_decodes_first_then_chunks_fill_the_budget():
    policy = make_policy("stall_free", {"token_budget": 256, "chunk_size": 100})
    d = policy.decide(view(DECODING, [seq(10, 4096), seq(11, 4096)]))
    assert d.schedule[:4] == [(i, 1) for i in range(4)]
    assert d.schedule[4:] == [(10, 100), (11, 100)]
    assert sum(n for _, n in d.schedule) <= 256


def test_stall_free_prefill_share_limits_prefill_when_decodes_run():
    policy = make_policy("stall_free", {"token_budget": 200, "max_prefill_share": 0.25})
    d = policy.decide(view(DECODING, [seq(10, 4096)]))
    assert dict(d.schedule)[10] == 50
    d = policy.decide(view([], [seq(10, 4096)]))  # no decodes: the solo budget, to the cap
    assert dict(d.schedule)[10] == 512


def test_stall_free_takes_larger_steps_while_nothing_decodes():
    policy = make_policy(
        "stall_free", {"token_budget": 256, "chunk_size": 100, "solo_budget": 1500}
    )
    d = policy.decide(view([], [seq(10, 4096), seq(11, 4096)], cap=4096))
    assert d.schedule == [(10, 1500)]  # one chunk as large as the solo budget
    d = policy.decide(view([], [seq(10, 1000), seq(11, 4096)], cap=1200))
    assert d.schedule == [(10, 1000), (11, 200)]  # the engine's cap bounds it
    d = policy.decide(view(DECODING, [seq(10, 4096), seq(11, 4096), seq(12, 4096)], cap=4096))
    assert sum(n for _, n in d.schedule) == 256 and dict(d.schedule)[10] == 100  # as before
    small = make_policy("stall_free", {"token_budget": 700, "chunk_size": 300, "solo_budget": 100})
    d = small.decide(view([], [seq(10, 4096), seq(11, 4096)], cap=4096))
    assert d.schedule == [(10, 700)]  # never below the budget with decodes


def test_priority_runs_lower_values_first_as_vllm_does():
    # vLLM's meaning: a lower `priority` value runs first, and 0 is the default
    policy = make_policy("priority", {"aging_rate": 0, "token_budget": 90, "chunk_size": 30})
    waiting = [
        seq(10, 30, priority=5, arrival=1.0),
        seq(11, 30, arrival=2.0),  # the default, 0
        seq(12, 30, priority=-3, arrival=3.0),
    ]
    d = policy.decide(view([], waiting))
    assert d.schedule == [(12, 30), (11, 30), (10, 30)]  # -3, 0, 5: against arrival order
    decoders = [seq(1, 20, generated=3, priority=2), seq(2, 20, generated=3, priority=-1)]
    d = policy.decide(view(decoders, [], max_seqs=1))
    assert d.schedule == [(2, 1)]  # the one slot goes to the lower value
    # preemption: a blocked request evicts a running one of a higher value, never a lower one
    running = [seq(3, 32, generated=1, priority=7)]  # holds 2 blocks
    d = policy.decide(view(running, [seq(4, 30, priority=0)], free=0))
    assert d.preempt == [3] and (4, 30) in d.schedule
    running = [seq(3, 32, generated=1, priority=0)]
    d = policy.decide(view(running, [seq(4, 30, priority=7)], free=0))
    assert d.preempt == [] and d.schedule == [(3, 1)]


def test_priority_orders_by_aged_priority_and_preempts_less_important():
    policy = make_policy("priority", {"aging_rate": 1.0, "preempt": True, "token_budget": 64})
    minor_old = seq(1, 20, priority=5, arrival=0.0)
    d = policy.decide(view([], [minor_old, seq(2, 20, priority=0, arrival=2.5)], now=3.0))
    assert d.schedule[0][0] == 2  # 0 - 0.5 beats 5 - 3
    d = policy.decide(view([], [minor_old, seq(2, 20, priority=0, arrival=9.0)], now=10.0))
    assert d.schedule[0][0] == 1  # aged: 5 - 10 beats a newcomer's 0 - 1

    running_minor = seq(3, 32, priority=9, generated=1)  # holds 2 blocks
    d = policy.decide(view([running_minor], [seq(4, 30, priority=0, arrival=9.9)], free=0))
    assert d.preempt == [3] and (4, 30) in d.schedule and (3, 1) not in d.schedule
    same = seq(5, 30, priority=9, arrival=9.9)
    d = policy.decide(view([running_minor], [same], free=0))
    assert d.preempt == []  # never for an equal base priority


def priority_step(budget: int, running, waiting, *, max_seqs: int = 64):
    policy = make_policy("priority", {"aging_rate": 0, "token_budget": budget, "chunk_size": 40})
    return policy.decide(view(running, waiting, free=0, max_seqs=max_seqs))


IMPORTANT_DECODER = seq(1, 20, generated=3, priority=0)  # holds 2 blocks, needs no new one
MINOR_DECODERS = [seq(2, 20, generated=3, priority=9), seq(3, 20, generated=3, priority=9)]
URGENT = seq(9, 40, priority=0)  # waiting, needs 3 blocks for a 40-token chunk


def test_priority_preempts_what_the_urgent_prompt_needs_whatever_its_first_chunk():
    d = priority_step(40, [IMPORTANT_DECODER, *MINOR_DECODERS], [URGENT])
    assert d.preempt == [3, 2]  # latest-arriving of the least important first, until 3 free
    assert d.schedule == [(1, 1), (9, 39)]  # the kept decode and what is left of the budget
    d = priority_step(3, [IMPORTANT_DECODER, *MINOR_DECODERS], [URGENT])
    # a 2-token chunk, but the core admits only the whole prompt's 3 blocks: both must go
    assert d.preempt == [3, 2]
    assert d.schedule == [(1, 1), (9, 2)]
    roomy = make_policy("priority", {"aging_rate": 0, "token_budget": 40, "chunk_size": 40})
    d = roomy.decide(view([IMPORTANT_DECODER, *MINOR_DECODERS], [URGENT], free=5, admit=1))
    assert d.preempt == [3]  # free blocks are promised to others: 1 admittable, 2 missing


def test_priority_at_the_sequence_cap_preempts_the_least_important_and_fcfs_does_not():
    at_cap = view([IMPORTANT_DECODER, *MINOR_DECODERS], [URGENT], free=3, max_seqs=3)
    policy = make_policy("priority", {"aging_rate": 0, "token_budget": 512})
    d = policy.decide(at_cap)
    assert d.preempt == [3]  # one slot: the latest-arriving of the least important
    assert dict(d.schedule) == {1: 1, 2: 1, 9: 40} and len(d.schedule) <= 3
    no_less_important = view([IMPORTANT_DECODER], [URGENT], free=3, max_seqs=1)
    assert policy.decide(no_less_important).preempt == []
    assert make_policy("fcfs", {}).decide(at_cap).preempt == []


def test_fair_serves_the_tenant_with_fewer_tokens():
    policy = make_policy("fair", {"token_budget": 64, "chunk_size": 64})
    a = [seq(i, 200, tenant="a") for i in range(3)]
    b = [seq(10, 200, tenant="b")]
    served = {"a": 0, "b": 0}
    for _ in range(10):
        d = policy.decide(view([], [*a, *b]))
        first = d.schedule[0][0]
        served["b" if first == 10 else "a"] += 1
    assert served == {"a": 5, "b": 5}  # per tenant, not per request


def test_fair_interleaves_tenants_within_one_step():
    policy = make_policy("fair", {"token_budget": 256, "chunk_size": 64})
    a = [seq(i, 200, tenant="a") for i in range(3)]
    b = [seq(10 + i, 200, tenant="b") for i in range(2)]
    d = policy.decide(view([], [*a, *b]))
    # each chunk handed out raises its tenant's counter before the next slot is chosen
    assert d.schedule == [(0, 64), (10, 64), (1, 64), (11, 64)]
    assert policy.counters == {"a": 128.0, "b": 128.0}


def test_fair_bills_a_tenant_for_tokens_computed_not_for_tokens_cached():
    """A waiting prompt whose first 192 tokens are in the prefix cache shows them as
    computed: the policy schedules and bills only the 8 that must be computed."""
    policy = make_policy("fair", {"token_budget": 256, "chunk_size": 256})
    # as the scheduler's view shows a waiting hit: computed and cached alike
    cached = dataclasses.replace(seq(1, 200, computed=192, tenant="a"), num_cached_tokens=192)
    cold = seq(2, 200, tenant="b")
    d = policy.decide(view([], [cached, cold]))
    assert d.schedule == [(1, 8), (2, 200)]
    assert policy.counters == {"a": 8.0, "b": 200.0}


def test_fair_interleaves_decodes_by_tenant_under_the_sequence_cap():
    policy = make_policy("fair", {})
    running = [seq(i, 20, generated=2, tenant="a") for i in range(4)]
    running.append(seq(9, 20, generated=2, tenant="b"))
    d = policy.decide(view(running, max_seqs=3))
    assert d.schedule == [(0, 1), (9, 1), (1, 1)]


def firsts_after(policy, seqs, steps: int) -> list[str]:
    tenants = {s.seq_id: s.tenant for s in seqs}
    return [tenants[policy.decide(view([], seqs)).schedule[0][0]] for _ in range(steps)]


def test_fair_newcomer_starts_level_with_the_active_tenants():
    policy = make_policy("fair", {"token_budget": 64, "chunk_size": 64})
    a = seq(1, 9999, tenant="a")
    firsts_after(policy, [a], 10)  # a alone banks 640 served tokens
    firsts = firsts_after(policy, [a, seq(2, 9999, tenant="c")], 6)
    assert firsts.count("c") == 3  # no catching up on the 640 tokens it was not there for


def test_fair_tenant_back_from_idle_cannot_spend_old_credit():
    policy = make_policy("fair", {"token_budget": 64, "chunk_size": 64})
    a, b = seq(1, 9999, tenant="a"), seq(2, 9999, tenant="b")
    firsts_after(policy, [a, b], 4)
    firsts_after(policy, [a], 10)  # b idle while a is served
    firsts = firsts_after(policy, [a, b], 6)
    assert firsts.count("b") == 3


def test_fair_weights_shift_the_share():
    policy = make_policy("fair", {"weights": {"a": 3}, "token_budget": 64, "chunk_size": 64})
    a, b = seq(1, 999, tenant="a"), seq(2, 999, tenant="b")
    firsts = [policy.decide(view([], [a, b])).schedule[0][0] for _ in range(40)]
    assert 25 <= firsts.count(1) <= 35  # about 3 of 4


def test_slo_chunk_shrinks_on_a_slower_machine_and_grows_on_a_faster_one():
    policy = make_policy("slo", {"itl_target_ms": 50, "min_chunk": 8, "max_budget": 4096})
    prompt = seq(10, 10000)
    chunks = []
    for ms_per_token in (0.2, 0.4, 0.1):
        cost = StepCost(base_ms=5.0, ms_per_token=ms_per_token, ms_per_pair=1e-5)
        d = policy.decide(view(DECODING, [prompt], cap=8192, cost=cost))
        chunks.append(dict(d.schedule)[10])
        assert (
            cost.decode_ms([s.num_computed_tokens for s in DECODING]) + cost.chunk_ms(0, chunks[-1])
            <= 0.9 * 50
        )
    assert chunks[1] < chunks[0] < chunks[2]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_respects_caps_and_blocks(name):
    policy = make_policy(name, {})
    running = [seq(i, 20, generated=2) for i in range(10)]
    waiting = [seq(100 + i, 700) for i in range(5)]
    d = policy.decide(view(running, waiting, cap=256, max_seqs=8, free=3))
    assert sum(n for _, n in d.schedule) <= 256
    assert len(d.schedule) <= 8
    assert len({s for s, _ in d.schedule}) == len(d.schedule)


@pytest.mark.parametrize("name", ["fcfs", "stall_free"])
def test_no_admission_asked_when_running_is_full(name):
    policy = make_policy(name, {})
    running = [seq(i, 20, generated=2) for i in range(4)]
    d = policy.decide(view(running, [seq(50, 30)], max_seqs=4))
    assert d.schedule == [(i, 1) for i in range(4)]
