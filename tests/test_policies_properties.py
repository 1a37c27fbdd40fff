"""Policies on random views, and the rules of each one that a few examples pin down.

tests/test_policies_decide.py shows each policy on hand-built views. Here hypothesis
generates views (decoding, half-prefilled and waiting sequences, scarce blocks, small caps)
and checks what every policy must return whatever it optimizes: known ids, no repeats,
1..remaining tokens, one token for a decode, the engine's caps, and block-aware admission.
The examples after that pin each policy's own rule at its edges (budgets, chunk sizes,
admission slots, aging, victims, counters, the SLO controller), and `parse_params`, which
turns an operator's untrusted JSON into a policy's parameters.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import Policy, PolicyError, SeqView, StepCost, View, parse_params
from policies.fair import Fair
from policies.fcfs import Fcfs
from policies.packing import fill_budget, split_running
from policies.priority import Priority
from policies.registry import POLICIES, describe_policies, make_policy
from policies.slo import Slo
from policies.stall_free import StallFree
from tests.policy_views import BLOCK, seq, view


def decoding(*ids: int, prompt: int = 20, tenant: str = "t") -> list[SeqView]:
    return [seq(i, prompt, generated=2, tenant=tenant) for i in ids]


# ---- every policy, random views ---------------------------------------------------------


@st.composite
def views(draw: st.DrawFn) -> View:
    block_size = BLOCK
    n_running = draw(st.integers(0, 6))
    n_waiting = draw(st.integers(0, 6))
    running, waiting = [], []
    for i in range(n_running):
        prompt = draw(st.integers(1, 200))
        generated = draw(st.integers(0, 5))
        # decoding: all but the newest token is in the cache; prefilling: part of the prompt
        partial = draw(st.integers(1, max(1, prompt - 1)))
        computed = prompt + generated - 1 if generated else partial
        running.append(
            SeqView(
                seq_id=i,
                tenant=draw(st.sampled_from("abc")),
                priority=draw(st.integers(0, 3)),
                arrival=draw(st.floats(0, 10)),
                prompt_len=prompt,
                num_generated=generated,
                num_computed_tokens=computed,
                num_blocks=max(1, -(-computed // block_size)),
                preempted=draw(st.integers(0, 2)),
            )
        )
    for i in range(n_waiting):
        prompt = draw(st.integers(1, 300))
        waiting.append(
            SeqView(
                seq_id=100 + i,
                tenant=draw(st.sampled_from("abc")),
                priority=draw(st.integers(0, 3)),
                arrival=draw(st.floats(0, 10)),
                prompt_len=prompt,
                num_generated=draw(st.integers(0, 3)),  # preempted ones keep their tokens
                num_computed_tokens=0,
                num_blocks=0,
                waiting=True,
            )
        )
    return View(
        iteration=draw(st.integers(1, 100)),
        now=draw(st.floats(10, 20)),
        running=tuple(running),
        waiting=tuple(waiting),
        num_waiting=len(waiting),
        free_blocks=draw(st.integers(0, 30)),
        total_blocks=100,
        block_size=block_size,
        max_batched_tokens=draw(st.integers(1, 300)),
        max_seqs=draw(st.integers(max(1, n_running), 8)),
        last_step_ms=draw(st.one_of(st.none(), st.floats(0.1, 500))),
        last_step_tokens=draw(st.integers(0, 300)),
    )


policy_instances = st.one_of(
    st.builds(lambda: make_policy("fcfs")),
    st.integers(0, 100).map(lambda n: make_policy("fcfs", {"max_batched_tokens": n})),
    st.builds(
        lambda b, c, s: make_policy(
            "stall_free", {"token_budget": b, "chunk_size": c, "max_prefill_share": s}
        ),
        st.integers(2, 300),
        st.integers(1, 100),
        st.sampled_from([0.5, 1.0]),
    ),
    st.builds(
        lambda a, p, b, c: make_policy(
            "priority", {"aging_rate": a, "preempt": p, "token_budget": b, "chunk_size": c}
        ),
        st.floats(0, 5),
        st.booleans(),
        st.integers(1, 300),
        st.integers(1, 100),
    ),
    st.builds(
        lambda w, b, c: make_policy("fair", {"weights": w, "token_budget": b, "chunk_size": c}),
        st.dictionaries(st.sampled_from("abc"), st.floats(0.1, 5), max_size=3),
        st.integers(1, 300),
        st.integers(1, 100),
    ),
    st.builds(
        lambda t, m: make_policy("slo", {"itl_target_ms": t, "min_chunk": m}),
        st.floats(1, 200),
        st.integers(1, 64),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policy_instances, views=st.lists(views(), min_size=1, max_size=3))
def test_every_policy_returns_a_decision_the_core_could_run_as_is(
    policy: Policy, views: list[View]
):
    for v in views:  # several views in a row: stateful policies (fair, slo) carry over
        decision = policy.decide(v)
        by_id = {s.seq_id: s for s in (*v.running, *v.waiting)}
        running = {s.seq_id for s in v.running}
        ids = [seq_id for seq_id, _ in decision.schedule]
        assert len(set(ids)) == len(ids), "a sequence listed twice"
        assert set(ids) <= set(by_id), "an unknown id"
        assert set(decision.preempt) <= running, "a victim that is not running"
        assert not set(decision.preempt) & set(ids), "a victim scheduled in the same step"
        for seq_id, tokens in decision.schedule:
            s = by_id[seq_id]
            assert 1 <= tokens <= s.remaining
            if s.is_decoding:
                assert tokens == 1
        decode_only = all(by_id[i].is_decoding for i in ids)
        if not (isinstance(policy, Fcfs) and decode_only):
            # fcfs lists every decode up to max_seqs, whatever the token cap (the core trims
            # when max_num_seqs > max_batched_tokens)
            assert sum(t for _, t in decision.schedule) <= v.max_batched_tokens
        assert len(decision.schedule) <= v.max_seqs
        admitted = [i for i in ids if i not in running]
        gone = len(decision.preempt)
        assert len(v.running) - gone + len(admitted) <= v.max_seqs
        if admitted:  # admission is block-aware: the step's blocks appear to fit
            need = sum(v.blocks_for(by_id[i], t) for i, t in decision.schedule)
            freed = sum(by_id[i].num_blocks for i in decision.preempt)
            assert need <= v.free_blocks + freed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    v=views(),
    budget=st.integers(1, 300),
    chunk=st.integers(1, 100),
    share=st.floats(0, 1),
    solo=st.integers(1, 400),
)
def test_stall_free_runs_every_decode_first_then_chunks_within_its_share(
    v: View, budget: int, chunk: int, share: float, solo: int
):
    if share * budget < 1 and share > 0:
        return  # rejected by the parameters' validation
    params = {
        "token_budget": budget,
        "chunk_size": chunk,
        "max_prefill_share": share,
        "solo_budget": solo,
    }
    decision = make_policy("stall_free", params).decide(v)
    decodes, _ = split_running(v)
    if not decodes:  # no stream to stall: the larger of the two budgets, in chunks as large
        budget = chunk = max(budget, solo)
    step_budget = min(budget, v.max_batched_tokens)
    expected_decodes = [s.seq_id for s in decodes][: min(v.max_seqs, step_budget)]
    assert decision.schedule[: len(expected_decodes)] == [(i, 1) for i in expected_decodes]
    prefill = decision.schedule[len(expected_decodes) :]
    assert all(tokens <= chunk for _, tokens in prefill)
    cap = max(1, int(share * step_budget)) if decodes else step_budget
    assert sum(tokens for _, tokens in prefill) <= cap
    assert sum(tokens for _, tokens in decision.schedule) <= step_budget
    assert decision.preempt == []


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v=views())
def test_fcfs_never_mixes_a_prefill_with_decodes_and_keeps_arrival_order(v: View):
    decision = Fcfs.from_params({}).decide(v)
    remaining = {s.seq_id: s.remaining for s in (*v.running, *v.waiting)}
    order = [s.seq_id for s in v.running if not s.is_decoding] + [s.seq_id for s in v.waiting]
    decodes = [s.seq_id for s in v.running if s.is_decoding]
    ids = [seq_id for seq_id, _ in decision.schedule]
    if set(ids) & set(order):  # a prefill step: prefill alone, in arrival order
        assert ids == order[: len(ids)]
        # whole prompts, except a lone first one longer than the budget
        for seq_id, tokens in decision.schedule:
            assert tokens == remaining[seq_id] or (
                len(ids) == 1 and tokens == v.max_batched_tokens < remaining[seq_id]
            )
    else:
        assert ids == decodes[: v.max_seqs]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v=views(), aging=st.floats(0, 5), budget=st.integers(1, 300), chunk=st.integers(1, 100))
def test_priority_victims_are_running_less_important_sequences_never_scheduled(
    v: View, aging: float, budget: int, chunk: int
):
    policy = make_policy(
        "priority", {"aging_rate": aging, "token_budget": budget, "chunk_size": chunk}
    )
    decision = policy.decide(v)
    ids = [seq_id for seq_id, _ in decision.schedule]
    assert len(set(ids)) == len(ids)
    by_id = {s.seq_id: s for s in (*v.running, *v.waiting)}
    for seq_id, tokens in decision.schedule:
        assert 1 <= tokens <= by_id[seq_id].remaining
    if decision.preempt:
        running = {s.seq_id: s for s in v.running}
        blocked_id, chunk = decision.schedule[-1]  # victims are named for this one request
        assert blocked_id not in running
        admitted = by_id[blocked_id]
        for victim in decision.preempt:
            assert running[victim].priority > admitted.priority  # a higher value: less important
            assert victim not in ids
        freed = sum(running[i].num_blocks for i in decision.preempt)
        assert v.blocks_for(admitted, chunk) <= v.free_blocks + freed


def test_priority_with_preemption_stays_within_its_token_budget():
    policy = make_policy("priority", {"token_budget": 64})  # preempt is on by default
    d = policy.decide(view([], [seq(10, 64), seq(11, 64)], cap=512))
    assert d.schedule == [(10, 64)]  # it schedules [(10, 64), (11, 64)]: 128 tokens


@pytest.mark.parametrize("value", ["--5", "\u00b2"])
def test_a_string_int_cannot_parse_is_a_policy_error(value: str):
    with pytest.raises(PolicyError, match="must be an integer"):
        make_policy("stall_free", {"token_budget": value})


# ---- fill_budget and split_running ------------------------------------------------------


def test_split_running_keeps_admission_order_in_both_halves():
    d1, p1, d2, p2 = (
        seq(1, 20, generated=1),
        seq(2, 50, computed=16),
        seq(3, 9, generated=4),
        seq(4, 40, computed=1),
    )
    dec, pre = split_running(view([d1, p1, d2, p2]))
    assert [s.seq_id for s in dec] == [1, 3]
    assert [s.seq_id for s in pre] == [2, 4]


def test_fill_budget_never_exceeds_the_engine_cap_even_with_a_larger_budget():
    v = view(decoding(1, 2, 3), [seq(10, 100)], cap=10)
    d = fill_budget(v, v.running, v.waiting, budget=500, prefill_cap=500, chunk_size=500)
    assert d.schedule == [(1, 1), (2, 1), (3, 1), (10, 7)]


def test_fill_budget_stops_decodes_when_the_budget_is_spent():
    v = view(decoding(1, 2, 3), [seq(10, 100)])
    d = fill_budget(v, v.running, v.waiting, budget=2, prefill_cap=100, chunk_size=100)
    assert d.schedule == [(1, 1), (2, 1)]


def test_fill_budget_stops_at_the_sequence_cap():
    v = view(decoding(1, 2), [seq(10, 100), seq(11, 100)], max_seqs=3)
    d = fill_budget(v, v.running, v.waiting, budget=500, prefill_cap=500, chunk_size=50)
    assert d.schedule == [(1, 1), (2, 1), (10, 50)]
    v = view(decoding(1, 2, 3), [seq(10, 100)], max_seqs=2)
    d = fill_budget(v, v.running, v.waiting, budget=500, prefill_cap=500, chunk_size=50)
    assert d.schedule == [(1, 1), (2, 1)]


def test_fill_budget_prefill_is_capped_by_its_own_cap_and_the_budget_left():
    v = view(decoding(1), [seq(10, 100), seq(11, 100)])
    d = fill_budget(v, v.running, v.waiting, budget=500, prefill_cap=30, chunk_size=20)
    assert d.schedule == [(1, 1), (10, 20), (11, 10)]
    d = fill_budget(v, v.running, v.waiting, budget=25, prefill_cap=500, chunk_size=20)
    assert d.schedule == [(1, 1), (10, 20), (11, 4)]


def test_fill_budget_admits_only_into_free_running_slots():
    running = [*decoding(1), seq(2, 100, computed=16)]  # one decoding, one prefilling
    v = view(running, [seq(10, 30), seq(11, 30)], max_seqs=3)
    d = fill_budget(
        v, v.running[:1], [running[1], *v.waiting], budget=500, prefill_cap=500, chunk_size=500
    )
    assert d.schedule == [(1, 1), (2, 84), (10, 30)]  # one slot: only the first waiting one


def test_fill_budget_admits_no_more_than_the_free_slots_when_a_running_one_sits_out():
    # 2 running (max 3): one slot. The prefilling one cannot get its 6 blocks this step,
    # which frees no slot: it is still running.
    running = [*decoding(1), seq(2, 100, computed=16)]
    v = view(running, [seq(10, 16), seq(11, 16)], free=2, max_seqs=3)
    d = fill_budget(
        v, v.running[:1], [running[1], *v.waiting], budget=500, prefill_cap=500, chunk_size=500
    )
    assert d.schedule == [(1, 1), (10, 16)]


def test_fill_budget_skips_a_prompt_that_does_not_fit_and_takes_a_smaller_one():
    v = view([], [seq(10, 100), seq(11, 40), seq(12, 30)], free=4)
    d = fill_budget(v, [], v.waiting, budget=500, prefill_cap=500, chunk_size=500)
    assert d.schedule == [(11, 40)]  # 100 needs 7 blocks; 40 needs 3; then 1 left < 2
    v = view([], [seq(10, 100), seq(11, 48), seq(12, 16)], free=4)
    d = fill_budget(v, [], v.waiting, budget=500, prefill_cap=500, chunk_size=500)
    assert d.schedule == [(11, 48), (12, 16)]  # exactly 3 + 1 blocks


def test_fill_budget_counts_the_blocks_decodes_will_need_before_admitting():
    full = [seq(i, 16, generated=1) for i in range(3)]  # each needs a second block
    v = view(full, [seq(10, 16)], free=3)
    d = fill_budget(v, v.running, v.waiting, budget=500, prefill_cap=500, chunk_size=500)
    assert d.schedule == [(0, 1), (1, 1), (2, 1)]  # the newcomer's block went to decodes
    v = view(full, [seq(10, 16)], free=4)
    d = fill_budget(v, v.running, v.waiting, budget=500, prefill_cap=500, chunk_size=500)
    assert d.schedule[-1] == (10, 16)


def test_fill_budget_a_decode_filling_its_block_needs_no_new_one():
    almost_full = [seq(i, 15, generated=1) for i in range(3)]  # 15 cached + 1 to compute
    v = view(almost_full, [seq(10, 16)], free=1)
    d = fill_budget(v, v.running, v.waiting, budget=500, prefill_cap=500, chunk_size=500)
    assert d.schedule == [(0, 1), (1, 1), (2, 1), (10, 16)]


def test_fill_budget_lets_a_running_prefill_continue_when_no_slot_is_free():
    running = [seq(1, 100, computed=16), seq(2, 20, generated=1)]
    v = view(running, [seq(10, 30)], max_seqs=2)
    d = fill_budget(
        v, [running[1]], [running[0], *v.waiting], budget=500, prefill_cap=500, chunk_size=500
    )
    assert d.schedule == [(2, 1), (1, 84)]


def test_fill_budget_with_nothing_to_do_decides_nothing():
    decision = fill_budget(view(), [], [], budget=10, prefill_cap=10, chunk_size=10)
    assert (decision.schedule, decision.preempt) == ([], [])


def test_fill_budget_tells_its_budget_capped_by_the_engine():
    """Drafted tokens (speculative decoding) take only what the policy's budget leaves."""
    capped = fill_budget(view(), [], [], budget=10**6, prefill_cap=10, chunk_size=10)
    assert capped.token_budget == view().max_batched_tokens
    assert fill_budget(view(), [], [], budget=7, prefill_cap=7, chunk_size=7).token_budget == 7


# ---- stall_free ----------------------------------------------------------------------------


def test_stall_free_gives_a_prompt_one_token_even_when_the_share_rounds_to_zero():
    policy = make_policy("stall_free", {"token_budget": 10, "max_prefill_share": 0.1})
    d = policy.decide(view(decoding(1, 2), [seq(10, 100)]))
    assert d.schedule == [(1, 1), (2, 1), (10, 1)]
    policy = make_policy("stall_free", {"token_budget": 100, "max_prefill_share": 0.0})
    d = policy.decide(view(decoding(1, 2), [seq(10, 100)]))
    assert d.schedule == [(1, 1), (2, 1), (10, 1)]


def test_stall_free_share_is_of_the_step_budget_capped_by_the_engine():
    policy = make_policy("stall_free", {"token_budget": 400, "max_prefill_share": 0.5})
    d = policy.decide(view(decoding(1), [seq(10, 1000)], cap=100))
    assert d.schedule == [(1, 1), (10, 50)]


def test_stall_free_prefill_share_is_validated_against_the_budget():
    with pytest.raises(PolicyError, match="one token"):
        make_policy("stall_free", {"token_budget": 4, "max_prefill_share": 0.2})
    assert make_policy("stall_free", {"token_budget": 5, "max_prefill_share": 0.2})
    assert make_policy("stall_free", {"token_budget": 4, "max_prefill_share": 0.0})


# ---- fcfs ----------------------------------------------------------------------------------


def test_fcfs_own_budget_caps_the_prefill_below_the_engine_cap():
    policy = make_policy("fcfs", {"max_batched_tokens": 100})
    d = policy.decide(view([], [seq(10, 60), seq(11, 60)], cap=512))
    assert d.schedule == [(10, 60)]
    d = policy.decide(view([], [seq(12, 300)], cap=512))
    assert d.schedule == [(12, 100)]
    d = policy.decide(view([], [seq(12, 300)], cap=50))  # and never above the engine's
    assert d.schedule == [(12, 50)]


def test_fcfs_continues_an_overlong_prompt_before_anything_else():
    policy = make_policy("fcfs")
    half_done = seq(1, 1000, computed=512, blocks=32)
    d = policy.decide(view([*decoding(2, 3), half_done], [seq(10, 30)], cap=512))
    assert d.schedule == [(1, 488)]  # the rest of it; the newcomer waits for its own step
    d = policy.decide(view([*decoding(2, 3), half_done], [seq(10, 30)], cap=600))
    assert d.schedule == [(1, 488), (10, 30)]


def test_fcfs_a_prompt_exactly_the_budget_runs_whole_then_nothing_else_fits():
    policy = make_policy("fcfs")
    d = policy.decide(view([], [seq(10, 64), seq(11, 1)], cap=64))
    assert d.schedule == [(10, 64)]
    d = policy.decide(view([], [seq(10, 63), seq(11, 1), seq(12, 1)], cap=64))
    assert d.schedule == [(10, 63), (11, 1)]


def test_fcfs_admits_only_as_many_as_there_are_free_slots():
    policy = make_policy("fcfs")
    d = policy.decide(view(decoding(1, 2), [seq(10, 5), seq(11, 5), seq(12, 5)], max_seqs=4))
    assert d.schedule == [(10, 5), (11, 5)]
    d = policy.decide(view([], [seq(10, 5), seq(11, 5), seq(12, 5)], max_seqs=2))
    assert d.schedule == [(10, 5), (11, 5)]


def test_fcfs_a_running_prefill_and_waiting_prompts_share_the_sequence_cap():
    policy = make_policy("fcfs")
    running = [seq(1, 100, computed=16), seq(2, 100, computed=16)]
    d = policy.decide(view(running, [seq(10, 5)], max_seqs=2))
    assert d.schedule == [(1, 84), (2, 84)]  # no slot for a newcomer
    d = policy.decide(view(running, [seq(10, 5)], max_seqs=3))
    assert d.schedule == [(1, 84), (2, 84), (10, 5)]


def test_fcfs_stops_admitting_at_the_first_prompt_whose_blocks_do_not_fit():
    policy = make_policy("fcfs")
    d = policy.decide(view([], [seq(10, 32), seq(11, 17), seq(12, 1)], free=3))
    assert d.schedule == [(10, 32)]  # 11 needs 2 blocks, 1 left: strict order, 12 waits
    d = policy.decide(view([], [seq(10, 32), seq(11, 16)], free=3))
    assert d.schedule == [(10, 32), (11, 16)]  # exactly the 3 free blocks


def test_fcfs_decodes_go_on_when_no_prompt_fits_in_memory():
    policy = make_policy("fcfs")
    d = policy.decide(view(decoding(1, 2), [seq(10, 100)], free=2))
    assert d.schedule == [(1, 1), (2, 1)]


def test_fcfs_decodes_respect_the_sequence_cap():
    policy = make_policy("fcfs")
    d = policy.decide(view(decoding(1, 2, 3), [], max_seqs=2))
    assert d.schedule == [(1, 1), (2, 1)]


# ---- priority ------------------------------------------------------------------------------


def test_priority_effective_priority_ages_only_after_arrival():
    policy = make_policy("priority", {"aging_rate": 2.0})
    assert policy.effective(seq(1, 5, priority=3, arrival=4.0), now=6.5) == 3 - 2.0 * 2.5
    assert policy.effective(seq(1, 5, priority=3, arrival=4.0), now=4.0) == 3
    assert policy.effective(seq(1, 5, priority=3, arrival=9.0), now=4.0) == 3  # clock skew


def test_priority_orders_decodes_by_aged_priority_and_ties_by_arrival():
    policy = make_policy("priority", {"aging_rate": 0.0})
    running = [
        seq(1, 10, generated=1, priority=5, arrival=1.0),
        seq(2, 10, generated=1, priority=1, arrival=3.0),
        seq(3, 10, generated=1, priority=1, arrival=2.0),
    ]
    d = policy.decide(view(running, [], max_seqs=2))
    assert d.schedule == [(3, 1), (2, 1)]


def test_priority_budget_and_chunk_size_shape_the_prefill():
    policy = make_policy("priority", {"token_budget": 50, "chunk_size": 30})
    d = policy.decide(view(decoding(1), [seq(10, 100, priority=-2), seq(11, 100)]))
    assert d.schedule == [(1, 1), (10, 30), (11, 19)]


def test_priority_without_preemption_never_names_victims():
    policy = make_policy("priority", {"preempt": False})
    running_minor = seq(3, 32, priority=9, generated=1)
    d = policy.decide(view([running_minor], [seq(4, 30, priority=0)], free=0))
    assert d.preempt == [] and d.schedule == [(3, 1)]


def test_priority_names_no_victims_when_nothing_waits():
    policy = make_policy("priority")
    d = policy.decide(view(decoding(1, 2), [], free=0))
    assert d.preempt == [] and d.schedule == [(1, 1), (2, 1)]


def test_priority_needs_no_victims_when_the_waiting_ones_fit():
    policy = make_policy("priority")
    minor = seq(3, 32, priority=9, generated=1)
    d = policy.decide(view([minor], [seq(4, 30, priority=0)], free=3))
    assert d.preempt == [] and d.schedule == [(3, 1), (4, 30)]


def test_priority_victims_are_the_lowest_ranked_and_only_as_many_as_needed():
    policy = make_policy("priority", {"aging_rate": 0.0})
    running = [
        seq(1, 32, generated=1, priority=3, blocks=2),
        seq(2, 32, generated=1, priority=5, blocks=2),
        seq(3, 32, generated=1, priority=4, blocks=2),
    ]
    blocked = seq(10, 64, priority=0, arrival=9.0)  # 4 blocks
    d = policy.decide(view(running, [blocked], free=1))
    assert d.preempt == [2, 3]  # highest value first; 1 + 2 + 2 >= 4, priority-3 one kept
    assert d.schedule == [(1, 1), (10, 64)]


def test_priority_a_victim_freeing_exactly_the_shortfall_is_enough():
    policy = make_policy("priority", {"aging_rate": 0.0})
    running = [  # decoding within their second blocks: their next tokens need no new block
        seq(1, 30, generated=1, priority=5, blocks=2),
        seq(2, 30, generated=1, priority=5, blocks=2),
    ]
    d = policy.decide(view(running, [seq(10, 48, priority=0)], free=1))  # 3 needed, 1 free
    assert d.preempt == [2]  # the later-arrived of two equals is ranked lower
    assert (10, 48) in d.schedule


def test_priority_counts_the_blocks_of_the_decodes_it_keeps():
    """Decodes that cross into a new block take one each: the victims must free those too
    (the core runs the decision as is, tests above)."""
    policy = make_policy("priority", {"aging_rate": 0.0})
    running = [
        seq(1, 32, generated=1, priority=5, blocks=2),
        seq(2, 32, generated=1, priority=5, blocks=2),
    ]
    d = policy.decide(view(running, [seq(10, 48, priority=0)], free=1))  # 3 + 1 kept, 1 free
    assert d.preempt == [2, 1] and d.schedule == [(10, 48)]


def test_priority_keeps_everyone_when_eviction_would_not_make_room():
    policy = make_policy("priority", {"aging_rate": 0.0})
    running = [seq(1, 16, generated=1, priority=5, blocks=1)]
    d = policy.decide(view(running, [seq(10, 64, priority=0)], free=2))  # needs 4: 2 + 1 < 4
    assert d.preempt == [] and d.schedule == [(1, 1)]


def test_priority_sizes_the_blocked_chunk_by_budget_cap_and_chunk_size():
    running = [seq(1, 200, generated=1, priority=5, blocks=13)]
    for params, cap, chunk in [
        ({"token_budget": 16, "chunk_size": 64}, 512, 16),
        ({"token_budget": 64, "chunk_size": 16}, 512, 16),
        ({"token_budget": 64, "chunk_size": 64}, 16, 16),
    ]:
        policy = make_policy("priority", {"aging_rate": 0.0, **params})
        d = policy.decide(view(running, [seq(10, 200, priority=0)], free=0, cap=cap))
        assert d.preempt == [1]  # its 13 blocks admit the whole 200-token prompt
        assert d.schedule == [(10, chunk)]


def test_priority_only_the_best_blocked_waiting_request_gets_victims():
    policy = make_policy("priority", {"aging_rate": 0.0})
    running = [seq(1, 16, generated=1, priority=2, blocks=1)]
    waiting = [seq(10, 16, priority=3, arrival=1.0), seq(11, 16, priority=0, arrival=2.0)]
    d = policy.decide(view(running, waiting, free=0))
    assert d.preempt == [1] and d.schedule == [(11, 16)]  # for 11, not for 10


def test_priority_a_waiting_request_without_a_slot_does_not_stall_a_running_prompt():
    policy = make_policy("priority", {"aging_rate": 0.0, "preempt": False})
    running = [seq(1, 100, computed=16, priority=9)]
    d = policy.decide(view(running, [seq(10, 50, priority=0)], max_seqs=1))
    assert d.schedule == [(1, 84)]  # 10 ranks first but has no slot; 1 goes on


def test_priority_a_running_prefill_is_not_the_blocked_request():
    policy = make_policy("priority", {"aging_rate": 0.0})
    running = [seq(1, 100, computed=16, priority=0, blocks=1), seq(2, 16, generated=1, priority=9)]
    d = policy.decide(view(running, [seq(10, 16, priority=4)], free=0, cap=512))
    # the prefilling one could not grow either, but it is running: 10 is the one blocked
    assert d.preempt == [2]
    assert (10, 16) in d.schedule


# ---- fair ----------------------------------------------------------------------------------


def test_fair_counts_each_scheduled_token_against_its_tenant_divided_by_weight():
    policy = make_policy("fair", {"weights": {"a": 2}, "token_budget": 64, "chunk_size": 10})
    v = view(decoding(1, tenant="a") + decoding(2, tenant="b"), [seq(10, 100, tenant="b")])
    d = policy.decide(v)
    assert sorted(d.schedule) == [(1, 1), (2, 1), (10, 10)]
    assert policy.counters == {"a": 0.5, "b": 11.0}


def test_fair_a_new_tenant_starts_at_the_smallest_active_counter():
    policy = make_policy("fair", {"token_budget": 10, "chunk_size": 10})
    policy.counters = {"a": 30.0, "b": 12.0}
    policy.decide(view([], [seq(1, 5, tenant="a"), seq(2, 5, tenant="b"), seq(3, 5, tenant="c")]))
    # c entered at 12 (b's counter) before the step was counted
    assert policy.counters == {"a": 30.0, "b": 17.0, "c": 12.0 + 5}


def test_fair_a_first_tenant_starts_at_zero():
    policy = make_policy("fair")
    policy.decide(view([], [seq(1, 5, tenant="a")]))
    assert policy.counters == {"a": 5.0}


def test_fair_interleaves_a_tenants_requests_by_its_counter():
    policy = make_policy("fair", {"token_budget": 512, "chunk_size": 10})
    a = [seq(i, 100, tenant="a") for i in (1, 2, 3)]
    b = [seq(i, 100, tenant="b") for i in (4, 5)]
    d = policy.decide(view([], [*a, *b]))
    # a, b tie at 0 (a first by name); each chunk adds 10 to its tenant
    assert [i for i, _ in d.schedule] == [1, 4, 2, 5, 3]


def test_fair_decodes_are_ordered_by_tenant_counter():
    policy = make_policy("fair", {"token_budget": 3})
    policy.counters = {"a": 5.0, "b": 0.0}
    running = decoding(1, 2, tenant="a") + decoding(3, 4, tenant="b")
    d = policy.decide(view(running, []))
    # b is behind by 5 one-token decodes' worth only after both of its own: b, b, a
    assert d.schedule == [(3, 1), (4, 1), (1, 1)]


def test_fair_each_decode_advances_its_tenant_by_one_token_in_the_ordering():
    policy = make_policy("fair", {"token_budget": 2})
    policy.counters = {"a": 0.0, "b": 1.5}
    running = decoding(1, 2, 3, tenant="a") + decoding(4, tenant="b")
    d = policy.decide(view(running, []))
    # a at 0 then 1 is still below b's 1.5: a's first two decodes fill the budget
    assert d.schedule == [(1, 1), (2, 1)]


def test_fair_a_heavier_weight_advances_its_counter_more_slowly_in_the_ordering():
    policy = make_policy("fair", {"weights": {"a": 4}, "token_budget": 512, "chunk_size": 8})
    a = [seq(i, 100, tenant="a") for i in (1, 2, 3)]
    b = [seq(i, 100, tenant="b") for i in (4, 5)]
    d = policy.decide(view([], [*a, *b]))
    # a's counter grows by 2 per chunk, b's by 8: a, b (tie at 0, a first), a, a, b
    assert [i for i, _ in d.schedule] == [1, 4, 2, 3, 5]


def test_fair_weights_must_be_positive_numbers():
    for bad in [0, -1, "2", True, 2e6]:
        with pytest.raises(PolicyError, match="weight"):
            make_policy("fair", {"weights": {"a": bad}})
    assert make_policy("fair", {"weights": {"a": 1e6, "b": 0.001}})


# ---- slo -----------------------------------------------------------------------------------


def slo(**params: Any) -> Slo:
    base = {"itl_target_ms": 100, "headroom": 1.0, "min_chunk": 1}
    policy = make_policy("slo", {**base, **params})
    assert isinstance(policy, Slo)
    return policy


LINEAR = StepCost(base_ms=10.0, ms_per_token=1.0, ms_per_pair=0.0)  # 1 ms a token


def test_slo_runs_min_chunk_of_prefill_until_the_engine_has_a_cost_model():
    d = slo(min_chunk=8).decide(view(decoding(1, 2), [seq(10, 5000)], cap=100000))
    assert d.schedule == [(1, 1), (2, 1), (10, 8)]


def test_slo_prefill_fills_what_the_decodes_leave_of_the_target():
    running = decoding(1, 2, 3, 4)
    d = slo().decide(view(running, [seq(10, 10000)], cap=100000, cost=LINEAR))
    # 100 ms target - (10 ms base + 4 decodes at 1 ms) = 86 ms: 86 tokens of prefill
    assert d.schedule == [(1, 1), (2, 1), (3, 1), (4, 1), (10, 86)]


def test_slo_a_chunk_deep_in_a_prompt_is_shorter_by_its_attention_cost():
    cost = StepCost(base_ms=0.0, ms_per_token=0.1, ms_per_pair=1e-4)
    early = slo().decide(view([], [seq(10, 8000)], cap=100000, cost=cost)).schedule
    deep_seq = seq(10, 8000, computed=6000, blocks=400)
    deep = slo().decide(view([deep_seq], [], cap=100000, cost=cost)).schedule
    (_, early_tokens), (_, deep_tokens) = early[0], deep[0]
    assert deep_tokens < early_tokens / 2
    for start, tokens in ((0, early_tokens), (6000, deep_tokens)):  # as large as fits in 100 ms
        assert cost.chunk_ms(start, tokens) <= 100 < cost.chunk_ms(start, tokens + 1)


def test_slo_prefill_never_drops_below_min_chunk():
    slow = StepCost(base_ms=10.0, ms_per_token=100.0, ms_per_pair=0.0)
    d = slo(min_chunk=20).decide(
        view(decoding(*range(30)), [seq(100, 1000)], cap=100000, cost=slow)
    )
    # the decodes alone take 3 s of a 100 ms target; still all 30 and a 20-token chunk
    assert len(d.schedule) == 31 and dict(d.schedule)[100] == 20


def test_slo_headroom_scales_the_target_and_max_budget_caps_the_prefill():
    d = slo(headroom=0.5).decide(view([], [seq(10, 10000)], cap=100000, cost=LINEAR))
    assert d.schedule == [(10, 40)]  # 50 ms - 10 ms base
    d = slo(max_budget=25).decide(view([], [seq(10, 10000)], cap=100000, cost=LINEAR))
    assert d.schedule == [(10, 25)]


def test_slo_starts_waiting_requests_earliest_deadline_first_after_started_prefills():
    started = seq(1, 40, computed=8, blocks=1)
    waiting = [seq(2, 40), seq(3, 40, deadline=30.0), seq(4, 40, deadline=20.0)]
    d = slo(itl_target_ms=500).decide(view([started], waiting, cap=100000, cost=LINEAR))
    assert [i for i, _ in d.schedule] == [1, 4, 3, 2]


# ---- the step-cost model the policies read -----------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    per_token=st.floats(0.0, 5.0),
    per_pair=st.floats(0.0, 1e-2),
    start=st.integers(0, 8192),
    max_ms=st.floats(0.0, 5000.0),
    limit=st.integers(1, 4096),
)
def test_largest_chunk_is_the_most_tokens_that_cost_at_most_max_ms(
    per_token: float, per_pair: float, start: int, max_ms: float, limit: int
):
    cost = StepCost(base_ms=3.0, ms_per_token=per_token, ms_per_pair=per_pair)
    tokens = cost.largest_chunk(start, max_ms, limit)
    assert 1 <= tokens <= limit
    if tokens > 1:
        assert cost.chunk_ms(start, tokens) <= max_ms * (1 + 1e-9)
    if tokens < limit:
        assert cost.chunk_ms(start, tokens + 1) > max_ms * (1 - 1e-9)


def test_stall_free_bounds_a_deep_chunk_by_the_cost_of_an_early_one():
    cost = StepCost(base_ms=20.0, ms_per_token=0.35, ms_per_pair=4e-4)
    policy = make_policy("stall_free", {"token_budget": 512, "chunk_size": 512})
    deep = seq(10, 4096, computed=3584, blocks=224)
    d = policy.decide(view([*decoding(1, 2), deep], [], cost=cost))
    tokens = dict(d.schedule)[10]
    early_ms = cost.chunk_ms(0, 510)  # the budget less the two decodes
    assert tokens < 200
    assert cost.chunk_ms(3584, tokens) <= early_ms < cost.chunk_ms(3584, tokens + 1)
    early = policy.decide(view(decoding(1, 2), [seq(10, 4096)], cost=cost))
    assert dict(early.schedule)[10] == 510  # at the start of the prompt: the token budget


def test_stall_free_bounds_tokens_only_without_a_cost_model_or_when_told_to():
    cost = StepCost(base_ms=20.0, ms_per_token=0.35, ms_per_pair=4e-4)
    deep = seq(10, 4096, computed=3584, blocks=224)
    unbounded = make_policy("stall_free", {"bound_cost": False})
    for policy, c in ((make_policy("stall_free"), None), (unbounded, cost)):
        d = policy.decide(view([*decoding(1, 2), deep], [], cost=c))
        assert dict(d.schedule)[10] == 510


def test_stall_free_cost_bound_is_shared_by_every_chunk_of_the_step():
    cost = StepCost(base_ms=0.0, ms_per_token=1.0, ms_per_pair=0.0)
    policy = make_policy("stall_free", {"token_budget": 512, "chunk_size": 100})
    d = policy.decide(view(decoding(1), [seq(10, 60), seq(11, 60), seq(12, 60)], cost=cost))
    # 100 tokens' worth of time (one early chunk_size chunk): 60 + 40, nothing for the third
    assert d.schedule == [(1, 1), (10, 60), (11, 40)]


# ---- registry and parse_params ---------------------------------------------------------------


def test_every_policy_is_described_with_its_defaults():
    described = describe_policies()
    assert [d["name"] for d in described] == list(POLICIES)
    for d in described:
        cls = POLICIES[d["name"]]
        assert d["summary"] == cls.summary
        assert d["params"] == dataclasses.asdict(cls.Params())
        assert make_policy(d["name"]).describe() == {"name": d["name"], "params": d["params"]}


def test_make_policy_with_no_or_empty_params_uses_the_defaults():
    for name, cls in POLICIES.items():
        for params in (None, {}):
            policy = make_policy(name, params)
            assert type(policy) is cls and policy.params == cls.Params()


@pytest.mark.parametrize("name", [None, 3, "", "FCFS", ["fcfs"]])
def test_make_policy_rejects_anything_but_a_known_name(name: Any):
    with pytest.raises(PolicyError, match="unknown policy"):
        make_policy(name, {})


def test_make_policy_error_lists_the_known_names():
    with pytest.raises(PolicyError) as info:
        make_policy("lifo")
    for name in POLICIES:
        assert name in str(info.value)


def test_the_base_policy_decides_nothing_by_itself():
    with pytest.raises(NotImplementedError):
        Policy(None).decide(view())


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"token_budget": 64}, 64),
        ({"token_budget": "64"}, 64),
        ({"token_budget": " 64 "}, 64),
        ({"token_budget": 1}, 1),
        ({"token_budget": 1 << 20}, 1 << 20),
    ],
)
def test_integers_may_arrive_as_numbers_or_digit_strings(raw: dict, expected: int):
    params = make_policy("stall_free", raw).params
    assert params.token_budget == expected and type(params.token_budget) is int


@pytest.mark.parametrize(
    "value", [1.5, "1.5", "abc", "", None, True, False, [64], "6-4", "64-", "- 5", "X64"]
)
def test_an_integer_parameter_rejects_anything_else(value: Any):
    with pytest.raises(PolicyError, match="token_budget must be an integer"):
        make_policy("stall_free", {"token_budget": value})


@pytest.mark.parametrize(("value", "message"), [("-5", ">= 1"), ("0", ">= 1"), (-5, ">= 1")])
def test_a_negative_integer_string_is_parsed_then_range_checked(value: Any, message: str):
    with pytest.raises(PolicyError, match=message):
        make_policy("stall_free", {"token_budget": value})


@pytest.mark.parametrize(
    ("value", "expected"), [(0.5, 0.5), ("0.5", 0.5), (1, 1.0), ("1e-1", 0.1), (0, 0.0)]
)
def test_floats_accept_numbers_and_numeric_strings(value: Any, expected: float):
    params = make_policy("stall_free", {"max_prefill_share": value}).params
    assert params.max_prefill_share == expected and type(params.max_prefill_share) is float


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "must be a number"),
        ("x", "must be a number"),
        (None, "must be a number"),
        ([1], "must be a number"),
        (math.nan, "must be finite"),
        ("inf", "must be finite"),
        (-math.inf, "must be finite"),
        (1.5, "<= 1.0"),
        (-0.1, ">= 0.0"),
    ],
)
def test_a_float_parameter_rejects_non_numbers_non_finite_and_out_of_range(
    value: Any, message: str
):
    with pytest.raises(PolicyError, match=message):
        make_policy("stall_free", {"max_prefill_share": value})


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("true", True), ("FALSE", False), ("1", True), ("0", False)],
)
def test_booleans_accept_json_booleans_and_their_spellings(value: Any, expected: bool):
    assert make_policy("priority", {"preempt": value}).params.preempt is expected


@pytest.mark.parametrize("value", [1, 0, "yes", None, "maybe"])
def test_a_boolean_parameter_rejects_anything_else(value: Any):
    with pytest.raises(PolicyError, match="preempt must be true or false"):
        make_policy("priority", {"preempt": value})


@pytest.mark.parametrize("value", [[], "a=1", 3, None])
def test_a_dict_parameter_must_be_an_object(value: Any):
    with pytest.raises(PolicyError, match="weights must be an object"):
        make_policy("fair", {"weights": value})


def test_range_limits_are_inclusive():
    assert make_policy("stall_free", {"chunk_size": 1, "token_budget": 1 << 20})
    with pytest.raises(PolicyError, match=r"chunk_size must be >= 1, got 0"):
        make_policy("stall_free", {"chunk_size": 0})
    with pytest.raises(PolicyError, match=r"token_budget must be <= 1048576, got 1048577"):
        make_policy("stall_free", {"token_budget": (1 << 20) + 1})


def test_unknown_parameters_are_named_sorted_with_the_known_ones():
    with pytest.raises(PolicyError) as info:
        make_policy("fcfs", {"zeta": 1, "alpha": 2})
    assert str(info.value) == (
        "unknown parameter(s) ['alpha', 'zeta']; expected some of "
        "['max_adapters_per_step', 'max_batched_tokens']"
    )


def test_params_must_be_an_object():
    with pytest.raises(PolicyError, match=r"^params must be an object$"):
        parse_params(StallFree.Params, [("token_budget", 3)])  # type: ignore[arg-type]


def test_parse_params_returns_the_dataclass_with_defaults_for_missing_fields():
    params = parse_params(Priority.Params, {"aging_rate": "2.5"})
    assert params == Priority.Params(aging_rate=2.5)


def test_parse_params_works_for_dataclasses_with_evaluated_annotations():
    """A policy module without `from __future__ import annotations` has real type objects."""
    params_cls = dataclasses.make_dataclass(
        "Params",
        [
            ("count", int, field(default=1, metadata={"min": 1})),
            ("rate", float, field(default=0.5)),
            ("on", bool, field(default=False)),
            ("table", dict, field(default_factory=dict)),
            ("maybe", int | None, field(default=None)),
        ],
        frozen=True,
    )
    params = parse_params(
        params_cls,
        {"count": "3", "rate": "0.25", "on": "true", "table": {"a": 1}, "maybe": "x"},
    )
    assert params == params_cls(count=3, rate=0.25, on=True, table={"a": 1}, maybe="x")
    with pytest.raises(PolicyError, match="count must be an integer"):
        parse_params(params_cls, {"count": 2.5})
    with pytest.raises(PolicyError, match="count must be >= 1"):
        parse_params(params_cls, {"count": 0})
    with pytest.raises(PolicyError, match="rate must be a number"):
        parse_params(params_cls, {"rate": "fast"})
    with pytest.raises(PolicyError, match="on must be true or false"):
        parse_params(params_cls, {"on": 3})
    with pytest.raises(PolicyError, match="table must be an object"):
        parse_params(params_cls, {"table": 3})


def test_a_params_dataclass_that_refuses_the_values_becomes_a_policy_error():
    @dataclasses.dataclass(frozen=True)
    class Needs:
        required: int

    with pytest.raises(PolicyError, match="required"):
        parse_params(Needs, {})


def test_from_params_keeps_the_parsed_params_and_describe_reports_them():
    policy = Fair.from_params({"weights": {"a": 2}, "chunk_size": "32"})
    assert policy.params == Fair.Params(weights={"a": 2}, chunk_size=32)
    assert policy.describe() == {
        "name": "fair",
        "params": {"weights": {"a": 2}, "token_budget": 512, "chunk_size": 32},
    }


# ---- the view's own arithmetic ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("computed", "blocks", "new", "needed"),
    [
        (0, 0, 1, 1),
        (0, 0, 16, 1),
        (0, 0, 17, 2),
        (16, 1, 1, 1),
        (15, 1, 1, 0),
        (20, 2, 12, 0),
        (20, 2, 13, 1),
        (20, 5, 1, 0),  # holds more than it needs: never negative
    ],
)
def test_blocks_for_counts_the_extra_blocks_new_tokens_need(
    computed: int, blocks: int, new: int, needed: int
):
    s = seq(1, 100, computed=computed, blocks=blocks)
    assert view().blocks_for(s, new) == needed


def test_blocks_for_counts_a_block_in_every_kv_group_and_a_windowed_groups_cap():
    """Gemma 3's layout: a full group and five windowed ones, each holding 3 blocks at most."""
    hybrid = dataclasses.replace(view(), kv_caps=(None,) + (3,) * 5)
    running = seq(1, 100, computed=40, blocks=3 + 5 * 2)  # 3 entries, windows partly given back
    assert hybrid.blocks_for(running, 8) == 0  # still in its third entry
    assert hybrid.blocks_for(running, 9) == 6  # a fourth: one in each group
    waiting = dataclasses.replace(seq(2, 100), waiting=True)
    assert hybrid.blocks_for(waiting, 100) == 7 + 5 * 3  # 7 entries; the windows' capped


def test_a_sequence_view_knows_its_remaining_tokens_and_whether_it_decodes():
    waiting = seq(1, 10)
    assert (waiting.num_tokens, waiting.remaining, waiting.is_decoding) == (10, 10, False)
    prefilling = seq(2, 10, computed=4)
    assert (prefilling.remaining, prefilling.is_decoding) == (6, False)
    last_prompt_token = seq(3, 10, computed=9)
    assert (last_prompt_token.remaining, last_prompt_token.is_decoding) == (1, True)
    decoding_ = seq(4, 10, generated=3)
    assert (decoding_.num_tokens, decoding_.remaining, decoding_.is_decoding) == (13, 1, True)
    preempted = seq(5, 10, generated=3, computed=0)
    assert (preempted.remaining, preempted.is_decoding) == (13, False)
    done = seq(6, 10, computed=10)  # nothing left to compute: still one to sample
    assert (done.remaining, done.is_decoding) == (1, True)


@pytest.mark.parametrize("cls", [Fcfs, StallFree, Priority, Fair, Slo])
def test_policies_decide_nothing_on_an_empty_view(cls: type[Policy]):
    policy = cls.from_params({})
    assert policy.decide(view()).schedule == []


def test_fill_budget_admits_only_prompts_whose_whole_blocks_are_admittable():
    # 100 free blocks, but only 10 not promised to running prefills: a 400-token prompt
    # (25 blocks) would be refused by the core whatever its first chunk; a 64-token one fits
    big, small = seq(10, 400), seq(11, 64)
    d = make_policy("stall_free").decide(view([], [big, small], free=100, admit=10))
    assert d.schedule == [(11, 64)]
    d = make_policy("stall_free").decide(view([], [big, small], free=100, admit=0))
    assert d.schedule == []  # admission paused after a preemption: nobody is proposed
    d = make_policy("stall_free").decide(view([], [big, small], free=100))
    assert d.schedule == [(10, 400), (11, 64)]  # no promises: free blocks are admittable
