"""Tenants' slots in the scheduler's core (service/engine/tenants.py): with a tenant share
below 1, a tenant's flood of sequences does not keep another tenant's sequence waiting for a
running slot until the flood drains, whatever the policy decides; with no other tenant
waiting, the flood uses every slot (work-conserving)."""

from __future__ import annotations

import collections

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import Decision
from policies.registry import make_policy
from service.engine.invariants import check_invariants
from service.engine.request import Request, Status
from service.engine.scheduler import Scheduler
from tests.scheduler_helpers import make_request, make_scheduler, sampled_result

MAX_SEQS = 4
SHARE = 0.5  # two slots of four


def tenant_scheduler(policy: str = "stall_free") -> Scheduler:
    sched, _ = make_scheduler(
        num_blocks=512, max_tokens=64, max_seqs=MAX_SEQS, max_preemptions=100, tenant_share=SHARE
    )
    sched.policy = make_policy(policy)
    return sched


def step(sched: Scheduler) -> None:
    out = sched.schedule(now=0.0)
    if out.plan is not None:
        sched.update(out, sampled_result(out))
    check_invariants(sched)


def flood(sched: Scheduler, tenant: str, count: int, first_id: int = 0) -> list[Request]:
    requests = [make_request(first_id + i, 4, max_tokens=200, tenant=tenant) for i in range(count)]
    for request in requests:
        sched.add(request)
    return requests


def running_of(sched: Scheduler, tenant: str) -> int:
    return sum(r.tenant.split("/")[0] == tenant for r in sched.running)


def test_another_tenants_sequence_gets_a_slot_within_two_steps_of_a_flood():
    """Tenant a (sub-tenants included) fills every slot and has more waiting; b's one
    request runs within two steps, not after a's 200-token sequences finish."""
    sched = tenant_scheduler()
    flood(sched, "a/x", 8)
    for _ in range(3):
        step(sched)
    assert running_of(sched, "a") == MAX_SEQS
    b = make_request(100, 4, max_tokens=200, tenant="b")
    sched.add(b)
    for _ in range(2):
        step(sched)
    assert b.status is Status.RUNNING and b.num_generated >= 1
    assert running_of(sched, "a") == MAX_SEQS - 1  # the slot b took, no more
    assert sched.corrections["tenant_slots_preempted"] == 1
    for _ in range(5):  # a's preempted sequence stays out while it would go past its share
        step(sched)
    assert running_of(sched, "a") == MAX_SEQS - 1


def test_the_core_admits_a_waiting_tenant_the_policy_does_not_name():
    """A policy that only ever schedules a's sequences (or whose view ends before b's):
    the core gives b the slot a leaves, and counts it."""
    sched, policy = make_scheduler(
        num_blocks=512, max_tokens=64, max_seqs=MAX_SEQS, tenant_share=SHARE
    )
    a = flood(sched, "a", 8)
    policy.next = Decision(schedule=[(r.seq_id, r.remaining) for r in a])
    for _ in range(3):
        step(sched)
    b = make_request(100, 4, max_tokens=200, tenant="b")
    sched.add(b)
    for _ in range(2):
        step(sched)
    assert b.status is Status.RUNNING and b.num_generated >= 1
    assert sched.corrections["tenant_slots_given"] == 1


def test_a_tenant_alone_uses_every_slot():
    sched = tenant_scheduler()
    flood(sched, "a", 8)
    for _ in range(3):
        step(sched)
    assert running_of(sched, "a") == MAX_SEQS
    assert not sched.corrections["tenant_slots"] and not sched.corrections["tenant_slots_preempted"]


def test_slots_left_by_another_tenant_stay_usable():
    """b runs one sequence and wants no more: a takes the other three slots."""
    sched = tenant_scheduler()
    sched.add(make_request(100, 4, max_tokens=200, tenant="b"))
    flood(sched, "a", 8)
    for _ in range(3):
        step(sched)
    assert (running_of(sched, "a"), running_of(sched, "b")) == (MAX_SEQS - 1, 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["stall_free", "fcfs", "priority", "fair"]),
    arrivals=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 6), st.integers(1, 30)),
        min_size=1,
        max_size=12,
    ),
)
def test_no_tenant_runs_past_its_share_while_another_below_it_waits(policy, arrivals):
    """Arrivals of (tenant, sequences, max_tokens), one batch per step: after every step, a
    tenant holding more than its share of the slots means no other tenant below its share
    has a sequence waiting."""
    sched = tenant_scheduler(policy)
    cap, seq_id = int(MAX_SEQS * SHARE), 0
    for tenant, count, max_tokens in arrivals + [("a", 0, 0)] * 20:
        for _ in range(count):
            sched.add(make_request(seq_id, 4, max_tokens=max_tokens, tenant=tenant))
            seq_id += 1
        step(sched)
        running = collections.Counter(r.tenant for r in sched.running)
        waiting = {r.tenant for r in sched.waiting}
        for tenant in running:
            if running[tenant] > cap:
                assert all(running[t] >= cap for t in waiting - {tenant}), (running, waiting)
