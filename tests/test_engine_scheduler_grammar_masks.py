"""The scheduler and grammar masks (service.engine.masks fills them off the loop): a
constrained row whose mask is not filled yet never samples, a decode sits the step out, a
prefill chunk stops a token short, while the free rows run; once filled, the plan carries
the mask, and the accepted token empties it."""

from __future__ import annotations

from policies.base import Decision
from service.engine.masks import unmasked, waits_for_masks
from service.engine.request import Request, Status
from service.engine.scheduler import Scheduler
from tests.plan_columns import column
from tests.scheduler_helpers import SAMPLED, make_request, make_scheduler, sampled_result


def lacking(sched: Scheduler) -> list[Request]:
    """The masks the filler takes next: a step's worth (max_num_seqs)."""
    return unmasked(sched.constrained, sched.max_num_seqs)


class StubGrammar:
    """What the scheduler asks of a grammar: its mask, filled or not, and each token."""

    def __init__(self) -> None:
        self.mask: str | None = None
        self.filling = False
        self.accepted: list[int] = []
        self.is_terminated = False

    @property
    def needs_mask(self) -> bool:
        return self.mask is None and not self.filling

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        self.mask = None
        return True


def test_a_row_without_its_mask_never_samples_and_the_free_row_runs() -> None:
    sched, policy = make_scheduler()
    free, bound = make_request(0, 4), make_request(1, 4)
    bound.grammar = StubGrammar()
    sched.add(free)
    sched.add(bound)
    assert lacking(sched) == [bound]

    policy.next = Decision(schedule=[(0, 4), (1, 4)])
    out = sched.schedule(0.0)
    # the prefill chunk stops short of the token it would sample
    assert [(s.request.seq_id, s.num_tokens, s.samples) for s in out.scheduled] == [
        (0, 4, True),
        (1, 3, False),
    ]
    assert out.plan is not None and column(out.plan, "bitmask") == []
    sched.update(out, sampled_result(out))
    assert waits_for_masks(sched.constrained)

    policy.next = Decision(schedule=[(0, 1), (1, 1)])
    out = sched.schedule(1.0)
    assert [s.request.seq_id for s in out.scheduled] == [0]  # the decode sits the step out
    sched.update(out, sampled_result(out))
    assert sched.corrections["grammar_mask_pending"] == 2

    bound.grammar.mask = "mask-of-state-3"
    assert not waits_for_masks(sched.constrained) and lacking(sched) == []
    out = sched.schedule(2.0)
    assert out.plan is not None
    assert [s.samples for s in out.scheduled] == [True, True]
    assert column(out.plan, "bitmask") == [None, "mask-of-state-3"]
    sched.update(out, sampled_result(out))
    assert bound.grammar.accepted == [SAMPLED] and bound.grammar.mask is None
    assert lacking(sched) == [bound] and waits_for_masks(sched.constrained)


def test_masks_are_wanted_for_the_running_first_and_not_twice() -> None:
    sched, policy = make_scheduler(max_seqs=2)
    requests = [make_request(i, 4) for i in range(4)]
    for request in requests:
        request.grammar = StubGrammar()
        sched.add(request)
    policy.next = Decision(schedule=[(3, 3)])  # admitted, prefilling short of sampling
    sched.update(out := sched.schedule(0.0), sampled_result(out))
    assert requests[3].status is Status.RUNNING
    assert lacking(sched) == [
        requests[3],
        requests[0],
    ]  # a step's worth: max_num_seqs
    requests[3].grammar.filling = True  # in a batch now
    assert lacking(sched) == [requests[0], requests[1]]
    sched.remove(requests[0])
    assert requests[0] not in lacking(sched)
