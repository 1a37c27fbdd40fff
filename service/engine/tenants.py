"""Tenants' slots: with a `tenant_share` below 1 (--tenant-quota), a tenant past its share of
the running slots (`max_num_seqs` x share, at least 1) takes only slots that no other
tenant below its share waits for.

The scheduler acts on what TenantSlots says: when a step begins it preempts sequences of
tenants past their share (least progress lost, never one at the cap) until a slot is free
for each sequence such a tenant still wants; admission keeps those slots; and after the
policy's decision it admits the wanted sequences the policy did not name (its view shows
only the first `waiting_view`). With no other tenant waiting, a tenant may use every slot.
Each tenant's running count and waiting list are kept as they change, so this costs a step
work in the tenants and the running, not in the queue.
"""

from __future__ import annotations

import bisect
import collections

from service.engine.request import Request, account_of


class TenantSlots:
    """Each tenant's running and waiting sequences, and the slots those below their share
    want. The scheduler tells it every sequence that joins or leaves its lists."""

    def __init__(self, max_num_seqs: int, share: float) -> None:
        self.max_num_seqs = max_num_seqs
        self.share = share  # of the running slots, while other tenants wait
        self._running_of: collections.Counter[str] = collections.Counter()  # by account
        self._waiting_of: dict[str, list[Request]] = {}  # by account, arrival order

    @property
    def slots(self) -> int:
        """The running slots a tenant may hold while another tenant below them waits."""
        return max(1, int(self.max_num_seqs * self.share))

    def join_waiting(self, request: Request) -> None:
        queue = self._waiting_of.setdefault(account_of(request.tenant), [])
        bisect.insort(queue, request, key=lambda r: r.seq_id)

    def leave_waiting(self, request: Request) -> None:
        tenant = account_of(request.tenant)
        self._waiting_of[tenant].remove(request)
        if not self._waiting_of[tenant]:
            del self._waiting_of[tenant]

    def join_running(self, request: Request) -> None:
        self._running_of[account_of(request.tenant)] += 1

    def leave_running(self, request: Request) -> None:
        tenant = account_of(request.tenant)
        self._running_of[tenant] -= 1
        if not self._running_of[tenant]:
            del self._running_of[tenant]

    def wanted(self, but: str | None = None) -> dict[str, int]:
        """Slots each tenant (other than `but`) below its share wants for its waiting
        sequences, the tenant waiting longest first; empty without tenant quotas."""
        if self.share >= 1:
            return {}
        cap, wanted = self.slots, {}
        for tenant, queue in self._waiting_of.items():
            if tenant != but and self._running_of[tenant] < cap:
                wanted[tenant] = min(len(queue), cap - self._running_of[tenant])
        return dict(sorted(wanted.items(), key=lambda item: self._waiting_of[item[0]][0].seq_id))

    def short(self, running: list[Request]) -> int:
        """How many more slots must be free for what the tenants below their share want."""
        return sum(self.wanted().values()) - self._free(running)

    def past_share(self, running: list[Request]) -> list[Request]:
        """The running sequences of tenants past their share."""
        cap = self.slots
        return [r for r in running if self._running_of[account_of(r.tenant)] > cap]

    def leaves_wanted(self, request: Request, running: list[Request]) -> bool:
        """Whether admitting `request` leaves the slots other tenants below their share
        want: at its share, a tenant takes only slots nobody else waits for."""
        tenant = account_of(request.tenant)
        if self.share >= 1 or self._running_of[tenant] < self.slots:
            return True
        return self._free(running) > sum(self.wanted(but=tenant).values())

    def wanted_schedule(self, running: list[Request]) -> list[tuple[int, int]]:
        """The sequences tenants below their share want, as a decision's schedule: in each
        tenant's arrival order, as many as the free slots hold."""
        schedule: list[tuple[int, int]] = []
        free = self._free(running)
        for tenant, count in self.wanted().items():
            taken = self._waiting_of[tenant][: max(0, min(count, free - len(schedule)))]
            schedule += [(r.seq_id, r.remaining) for r in taken]
        return schedule

    def check_invariants(self, running: list[Request], waiting: list[Request]) -> None:
        """Its counts are those of the scheduler's lists."""
        assert self._running_of == collections.Counter(account_of(r.tenant) for r in running)
        assert sum(map(len, self._waiting_of.values())) == len(waiting), "a lost waiter"

    def _free(self, running: list[Request]) -> int:
        return self.max_num_seqs - len(running)
