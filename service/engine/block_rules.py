"""Who holds the KV cache's blocks: the scheduler's rules for admission, growth and
preemption. The scheduler validates a decision's entries; BlockRules says whether a waiting
one may be admitted and a running one may grow, and moves the sequences it admits and the
victims it preempts between the scheduler's lists:

- Admission counts the whole prompt. A waiting sequence (new, or preempted: then with the
  tokens it had generated) is admitted only if blocks for everything it computes before it
  samples fit in the free blocks that are not promised to admitted sequences still
  prefilling, minus the `watermark` kept for running ones to grow. Its blocks are allocated
  chunk by chunk; the rest are promised to it (BlockManager.promise). Only victims the
  policy named may be preempted to admit someone (for blocks, or for a sequence slot at
  `max_num_seqs`): the core never evicts for a newcomer.
- Hysteresis. A preemption pauses admission for the rest of its step and after, until the
  unpromised free blocks exceed `admission_watermark` (a fraction of the blocks, above the
  watermark; checked when a step begins and when a sequence leaves), so admission does not
  oscillate at the edge of the cache.
- Growth. A running sequence may take any free block, into the watermark and even blocks
  promised to a prefill (which then makes room the same way). If too few are free, it
  preempts (recompute) the policy's named victims first, then the others by least progress
  lost: fewest computed tokens, ties to the most recently admitted. A victim is never in
  this step nor preempted `max_preemptions` times already (a named one at the cap counts a
  correction). Preemption is all or nothing: if the allowed victims cannot free enough,
  nobody is preempted and the sequence waits this step (`no_blocks`).
- No deadlock. A request at the cap can never be a victim, so it is readmitted only if its
  whole life (prompt + max_tokens) fits, with those of the other running requests at the
  cap, in the whole cache. Then whenever none of those can grow, the rest (all under the
  cap) hold enough blocks to make room, so some sequence always runs and every request
  finishes, each preempted at most `max_preemptions` times.

Tenants' slots (--tenant-quota): service.engine.tenants says which slots a tenant past its
share may take; these rules preempt and admit as it says.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterable

from policies.base import Decision
from service.engine.block_manager import BlockManager, PrefixHit
from service.engine.plan import PlanBuilder
from service.engine.prefix_cache import prefix_hit
from service.engine.request import Request, Status
from service.engine.step import ScheduleOutput, StepDraft
from service.engine.tenants import TenantSlots


def _seq_key(request: Request) -> int:
    return request.seq_id


def _progress_lost(request: Request) -> tuple[int, int]:
    """Victim order: fewest computed tokens to recompute, then the most recently admitted."""
    return request.num_computed_tokens, -request.admitted_order


def _first_enough(
    short: int, candidates: Iterable[Request], gain: Callable[[int], int]
) -> list[Request] | None:
    """The first candidates whose preemption gains `short` blocks, or None if all of them
    together would not: a preemption that cannot make enough room is not made."""
    victims = []
    for victim in candidates:
        if short <= 0:
            break
        victims.append(victim)
        short -= gain(victim.seq_id)
    return victims if short <= 0 else None


class BlockRules:
    """The rules for blocks (module docstring) over the scheduler's running and waiting
    lists, which it alone moves sequences between (keeping its TenantSlots in step)."""

    def __init__(
        self,
        blocks: BlockManager,
        lists: tuple[list[Request], list[Request]],
        tenants: TenantSlots,
        plans: PlanBuilder,
        corrections: collections.Counter[str],
        *,
        max_num_seqs: int,
        max_preemptions: int,
        admission_watermark: float,
    ) -> None:
        self.blocks = blocks
        self.running, self.waiting = lists  # the scheduler's: admission, arrival order
        self.plans = plans  # told of each victim: the worker forgets it
        self.tenants = tenants
        self.corrections = corrections  # the scheduler's
        self.max_num_seqs = max_num_seqs
        self.max_preemptions = max_preemptions  # a request preempted this often is kept
        self.admission_watermark = admission_watermark  # fraction of the blocks
        self.admission_paused = False
        self.prefix_queries = 0  # tokens of the sequences admitted
        self.prefix_hits = 0  # of those, found in the prefix cache
        self._admissions = 0

    @property
    def admission_watermark_blocks(self) -> int:
        return int(self.admission_watermark * self.blocks.num_blocks)

    # ---- the lists ------------------------------------------------------------------

    def join_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_seq_key)
        self.tenants.join_waiting(request)

    def leave(self, request: Request) -> None:
        """`request` leaves whichever list holds it (it finished)."""
        if request.status is Status.RUNNING:
            self._leave_running(request)
        else:
            self._leave_waiting(request)
        self.resume_admission_if_room()

    def _leave_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        self.tenants.leave_waiting(request)

    def _join_running(self, request: Request) -> None:
        self.running.append(request)
        self.tenants.join_running(request)

    def _leave_running(self, request: Request) -> None:
        self.running.remove(request)
        self.tenants.leave_running(request)

    def join_received(self, request: Request) -> None:
        """A request whose prompt's K/V was pulled (all but its last token computed, its
        blocks allocated) runs: admitted without a waiting turn. Its prompt was a query of
        the prefix cache, hit as far as this server's cache held it (kv_pulls)."""
        self.prefix_queries += request.num_tokens
        self.prefix_hits += request.num_cached_tokens
        request.status = Status.RUNNING
        request.admitted_order = self._admissions
        self._admissions += 1
        self._join_running(request)

    # ---- admission ------------------------------------------------------------------

    def admit(self, request: Request, draft: StepDraft) -> bool:
        """Admit a waiting sequence if blocks for its whole prompt fit (module docstring),
        starting from its cached prefix."""
        slot_victim = None
        if len(self.running) >= self.max_num_seqs:
            # every slot taken: only a victim the policy named gives up its own
            slot_victim = next(iter(self._named_victims(request, draft)), None)
            if slot_victim is None:
                self.corrections["max_seqs"] += 1
                return False
        if self.admission_paused:
            self.corrections["admission_paused"] += 1
            return False
        if not self.tenants.leaves_wanted(request, self.running):
            self.corrections["tenant_slots"] += 1
            return False
        if slot_victim is not None:  # a slot, not blocks: no reason to pause admission
            self.preempt(slot_victim, draft.out, pause=False)
        hit = prefix_hit(self.blocks, request)
        victims = self._admission_victims(request, hit, draft)
        if victims is None:
            self.corrections["admission_deferred"] += 1
            return False
        for victim in victims:
            self.preempt(victim, draft.out)
        self._leave_waiting(request)
        request.status = Status.RUNNING
        request.admitted_order = self._admissions
        self._admissions += 1
        self._join_running(request)
        self._start_from_cache(request, hit)
        self.blocks.promise(request.seq_id, request.num_tokens)
        return True

    def _start_from_cache(self, request: Request, hit: PrefixHit) -> None:
        self.blocks.share(request.seq_id, hit)
        request.num_computed_tokens = hit.num_blocks * self.blocks.block_size
        if request.first_scheduled is None:  # what its usage reports: the first admission
            request.num_cached_tokens = min(request.num_computed_tokens, request.prompt_len)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += request.num_computed_tokens

    def _admission_victims(
        self, request: Request, hit: PrefixHit, draft: StepDraft
    ) -> list[Request] | None:
        """Who must go for `request` to fit (often nobody), or None if it cannot fit."""
        if self._at_cap(request) and not self._life_fits_beside_the_kept(request):
            return None
        short = self.blocks.admission_shortfall(request.num_tokens, hit)
        if short <= 0:
            return []
        named = self._named_victims(request, draft)
        hit_blocks = set(hit.blocks)

        def gain(seq_id: int) -> int:
            # a hit block only the victim holds turns evictable: freed, then taken back
            lost = sum(
                1
                for b in self.blocks.held(seq_id)
                if b in hit_blocks and self.blocks.refcount(b) == 1
            )
            return self.blocks.num_claimed(seq_id) - lost

        return _first_enough(short, named, gain)

    def _life_fits_beside_the_kept(self, request: Request) -> bool:
        """A request that can no longer be preempted must be able to finish: its whole life,
        with those of the running ones like it, fits in the cache (no deadlock)."""
        kept = [r for r in self.running if self._at_cap(r)]
        lives = sum(self._blocks_for_life(r) for r in [*kept, request])
        return lives <= self.blocks.num_blocks

    def _blocks_for_life(self, request: Request) -> int:
        assert request.params.max_tokens is not None  # validation fills it
        return self.blocks.blocks_to_hold(request.prompt_len + request.params.max_tokens)

    def resume_admission_if_room(self) -> None:
        """The end of the pause a preemption began: enough blocks are back (hysteresis)."""
        if self.blocks.num_available > self.admission_watermark_blocks:
            self.admission_paused = False

    # ---- growth and preemption ------------------------------------------------------

    def policy_victims(self, decision: Decision) -> list[Request]:
        """The running sequences the decision offers to preempt, under the cap, in order."""
        victims: list[Request] = []
        seen: set[int] = set()
        running = {r.seq_id: r for r in self.running} if decision.preempt else {}
        for seq_id in decision.preempt:
            request = running.get(seq_id) if isinstance(seq_id, int) else None
            if request is None or seq_id in seen:
                self.corrections["bad_preempt_id"] += 1
                continue
            seen.add(seq_id)
            if self._at_cap(request):
                self.corrections["preempt_cap"] += 1
                continue
            victims.append(request)
        return victims

    def make_room(self, request: Request, tokens: int, draft: StepDraft) -> bool:
        """Blocks for a running sequence's next tokens: free ones, else victims'."""
        needed = request.num_computed_tokens + tokens
        short = self.blocks.extra_blocks(request.seq_id, needed) - self.blocks.num_free
        if short <= 0:
            return True
        victims = _first_enough(short, self._growth_victims(request, draft), self.blocks.num_held)
        if victims is None:
            self.corrections["no_blocks"] += 1
            return False
        for victim in victims:
            self.preempt(victim, draft.out)
        return True

    def _growth_victims(self, request: Request, draft: StepDraft) -> list[Request]:
        """The policy's victims in its order, then the others by least progress lost."""
        named = self._named_victims(request, draft)
        taken = {r.seq_id for r in named} | draft.chosen
        others = [
            r
            for r in self.running
            if r is not request and r.seq_id not in taken and not self._at_cap(r)
        ]
        return named + sorted(others, key=_progress_lost)

    def _named_victims(self, request: Request, draft: StepDraft) -> list[Request]:
        return [
            r
            for r in draft.victims
            if r is not request and r.status is Status.RUNNING and r.seq_id not in draft.chosen
        ]

    def _at_cap(self, request: Request) -> bool:
        return request.preemptions >= self.max_preemptions

    def preempt(self, victim: Request, out: ScheduleOutput, *, pause: bool = True) -> None:
        """Back to waiting, to be recomputed: its blocks are freed, the worker forgets it."""
        self.blocks.free(victim.seq_id)
        self.plans.forget(victim.seq_id)
        self._leave_running(victim)
        victim.reset_for_recompute()
        self.join_waiting(victim)
        out.preempted.append(victim)
        self.admission_paused = self.admission_paused or pause

    def yield_slots(self, out: ScheduleOutput) -> None:
        """Preempt sequences of tenants past their share, least progress lost first and
        never one at the cap, until the free slots cover what the tenants below theirs
        want. Not a block shortage: admission is not paused."""
        if self.admission_paused:
            return  # nobody could take the slot
        for _ in range(self.tenants.short(self.running)):
            over = [r for r in self.tenants.past_share(self.running) if not self._at_cap(r)]
            victim = min(over, key=_progress_lost, default=None)
            if victim is None:
                return
            self.preempt(victim, out, pause=False)
            self.corrections["tenant_slots_preempted"] += 1
