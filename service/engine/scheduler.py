"""The owner of the iteration: `schedule()` decides a step, `update()` applies its result.

schedule(): view -> policy decision -> core validation -> blocks -> BatchPlan. The policy
proposes; this module disposes. Whatever the decision says, a step never holds more than
`max_batched_tokens` tokens or `max_num_seqs` sequences, a decoding sequence computes
exactly one token, a prefill chunk never runs past its sequence, and blocks come from free
ones only. Every fix is counted in `corrections` so tests can see it. The rules for blocks:

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

Tenants' slots. With a `tenant_share` below 1 (--tenant-quota), a tenant past its share of
the running slots (`max_num_seqs` x share, at least 1) takes only slots that no other tenant
below its share waits for: when a step begins, the core preempts sequences of tenants past
their share (least progress lost, never one at the cap) until a slot is free for each
sequence such a tenant still wants; admission keeps those slots; and after the policy's
decision the core admits the wanted sequences the policy did not name (its view shows only
the first `waiting_view`). With no other tenant waiting, a tenant may use every slot. Each
tenant's running count and waiting list are kept as they change, so this costs a step work
in the tenants and the running, not in the queue.

Prefix caching. A waiting sequence starts with its longest cached prefix of full blocks
(never the whole of its tokens: the step must compute at least the last one to sample):
admission shares those blocks and counts only what they do not cover, a hit block that
others hold costing nothing; the policy's view shows the hit as computed already. A block
is registered in the cache by update(), once the step that filled it has returned, so a
hit never names a block a failed step left half-written.

update(): the scheduled tokens are now cached; each sampled token is appended; EOS, a
stop_token_ids token and max_tokens finish a sequence and free its blocks. A request with
a grammar (structured output) sends the tokens it allows with each plan that samples it,
and its grammar takes each token appended; a grammar that has taken its end token
finishes it too. The engine fills those masks off the loop (service.engine.masks): a
constrained row whose mask is not filled yet does not sample (a decode sits the step out,
a prefill chunk stops a token short; counted as `grammar_mask_pending`). Text
(detokenization, stop strings) and streams are the engine's business, which is what keeps
this module free of I/O: a whole iteration runs without trio or a worker.

Histories. A sequence whose sampling reads its tokens (penalties, bad words, min_tokens)
has them counted by the worker: its first plan after each admission carries a History (its
prompt length, and the tokens a prefix-cache hit skips), and the first plan after it ends
or is preempted releases it, so no plan carries a sequence's tokens twice.

Sliding windows. The blocks of layers that attend within a window (every layer of a
Mistral; 15 of 18 layers of Gemma 3 270M, a KV group of their own: BlockManager) are
released by update() once wholly behind a sequence's window (drop_behind_window), so such
a group holds about window / block_size blocks of a long sequence. Admission counts what a
prompt holds at its peak: all its blocks in a full group, a windowed group's up to its cap
(the window's blocks and a chunk's), so a prompt longer than the cache may still fit on a
model whose every layer is windowed.

Speculative decoding (--speculative-config; service.engine.speculation says what is
drafted, and how much a step may carry). Once the decision is applied, each decoding
sequence may append drafted tokens to its one token, from the budget the step leaves and
from free blocks that are neither promised nor in the watermark, so drafts never preempt
nor delay an admission. The worker accepts j of a sequence's k drafts and samples one
token after them: update() counts 1 + j tokens computed, gives back the blocks past them
(BlockManager.trim: between steps a sequence holds the blocks of its computed tokens,
drafts or not), and appends the tokens one by one, any of which may finish it (EOS, a
stop token, max_tokens: the rest are dropped). A block is registered in the prefix cache
only once its positions are computed and their tokens appended, so a block that held a
rejected draft's K/V is never found as if it held the token that replaced it.

Pooling (embeddings). A pooled request never samples: its chunks carry what the worker
pools of them (BatchPlan.pooling), and update() finishes it (POOLED) with the step that
computes its prompt's last token. A mean-pooled one takes no prefix-cache hit, since every
row's state is summed, so its sum starts again at 0 after a preemption.
"""

from __future__ import annotations

import base64
import bisect
import collections
import dataclasses
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from gpu_worker.protocol import (
    DRAFT_MODEL_TOKEN,
    POOL_LAST,
    POOL_SUM,
    BatchPlan,
    History,
    StepResult,
    TokenLogprobs,
)
from policies.base import Decision, Policy, SeqView, View
from service.engine.block_manager import BlockManager, PrefixHit, chain_hashes
from service.engine.request import MEAN_POOLING, Request, Status, account_of
from service.engine.speculation import Speculator, may_draft
from service.engine.step_cost import StepCostModel

STOP_TOKEN = ("stop", "stop_token")  # a stop_token_ids token finished the sequence
POOLED = ("stop", "pooled")  # a pooled request (an embedding) computed its prompt


@dataclass(slots=True)
class Scheduled:
    request: Request
    num_tokens: int  # of its own tokens (a decode's: 1)
    samples: bool
    drafts: list[int] = field(default_factory=list)  # drafted tokens it verifies after them
    # a draft model's (Drafted): what it computes first, from position draft_start
    draft_context: list[int] = field(default_factory=list)
    draft_start: int = 0

    @property
    def chunk(self) -> int:
        """Tokens it computes this step, drafts included."""
        return self.num_tokens + len(self.drafts)


@dataclass(slots=True)
class ScheduleOutput:
    iteration: int
    policy: str  # the policy that decided this step
    plan: BatchPlan | None
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)  # scheduled for the first time
    prefill_tokens: int = 0
    decode_seqs: int = 0
    drafting_seqs: int = 0  # sequences with drafted tokens
    draft_tokens: int = 0  # drafted tokens, over all of them
    accepted_tokens: int = 0  # of those, accepted (known once update() ran)


@dataclass(slots=True)
class Outcome:
    """What one step did to one request."""

    request: Request
    token: int | None = None  # the sampled token, appended to request.token_ids
    logprobs: TokenLogprobs | None = None  # of the token, if the request asked for them
    finish: tuple[str, str] | None = None  # (reason, detail): finished and freed here
    error: str | None = None


@dataclass(slots=True)
class _Draft:
    """The step being assembled from one decision."""

    out: ScheduleOutput
    victims: list[Request]  # running sequences the policy offered, under the cap, in order
    chosen: set[int]  # seq_ids already in the step
    budget: int  # tokens still free in the step


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    iteration: int  # the last iteration scheduled
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_promised: int  # to admitted sequences still prefilling, not yet allocated
    admission_paused: bool  # since a preemption, until blocks exceed admission_watermark
    kv_blocks_cached: int  # registered in the prefix cache, held or evictable
    kv_blocks_evictable: int  # cached and held by nobody: free, until evicted
    prefix_queries: int  # tokens of the sequences admitted, summed over admissions
    prefix_hits: int  # of those, tokens found in the prefix cache
    kv_blocks_evicted: int  # cached blocks reused for others since the worker started
    draft_tokens: int = 0  # drafted tokens verified since the start (speculative decoding)
    accepted_tokens: int = 0  # of those, accepted


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


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        policy: Policy,
        *,
        max_batched_tokens: int,
        max_num_seqs: int,
        eos_token_ids: Collection[int],
        max_preemptions: int,
        admission_watermark: float,
        waiting_view: int = 256,
        tenant_share: float = 1.0,
        speculator: Speculator | None = None,
    ) -> None:
        self.blocks = blocks
        self.policy = policy
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_preemptions = max_preemptions  # a request preempted this often is kept
        self.admission_watermark = admission_watermark  # fraction of the blocks
        self.admission_paused = False
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting_view = waiting_view  # policies see this many of the waiting, in order
        self.running: list[Request] = []  # admission order
        self.waiting: list[Request] = []  # arrival order (seq_id)
        self.tenant_share = tenant_share  # of the running slots, while other tenants wait
        self._running_of: collections.Counter[str] = collections.Counter()  # by account
        self._waiting_of: dict[str, list[Request]] = {}  # by account, arrival order
        self.corrections: collections.Counter[str] = collections.Counter()
        self.iteration = 0  # the last one scheduled
        self._pending_policy: Policy | None = None
        self._by_seq: dict[int, Request] = {}
        # a request's later sequences (n > 1), by its first's id, until the first has
        # computed the prompt they share: they then find it in the prefix cache
        self._held: dict[str, list[Request]] = {}
        self._constrained: dict[int, Request] = {}  # those with a grammar, by seq_id
        self._released: list[int] = []  # histories the next plan tells the worker to drop
        self._admissions = 0
        self._last_step_ms: float | None = None
        self._last_step_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.step_cost = StepCostModel()  # fitted to every step's measured time
        self.speculator = speculator  # None: nothing is drafted
        self.draft_tokens = 0  # verified since the start
        self.accepted_tokens = 0

    # ---- membership -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._by_seq[request.seq_id] = request
        if request.grammar is not None:
            self._constrained[request.seq_id] = request
        self._join_waiting(request)

    def hold(self, leader: Request, siblings: list[Request]) -> None:
        """Queue `siblings` behind `leader`: they join the waiting once release_held(leader)."""
        self._held[leader.request_id] = siblings

    def release_held(self, leader: Request) -> bool:
        """The leader computed its prompt (or ended): its held siblings join the waiting,
        with its prompt's log-probabilities (`echo`) when it has them all; False if none."""
        siblings = self._held.pop(leader.request_id, [])
        for sibling in siblings:
            if leader.prompt_logprobs is not None and not leader.needs_prompt_logprobs:
                sibling.prompt_logprobs = leader.prompt_logprobs  # then it may start cached
            if not sibling.is_finished:
                self.add(sibling)
        return bool(siblings)

    def queued_sequences(self) -> int:
        """Sequences waiting to start, the held ones too."""
        return len(self.waiting) + sum(len(held) for held in self._held.values())

    def expired(self, now: float) -> list[Request]:
        """Waiting requests whose deadline to start has passed (the engine ends them)."""
        return [
            r
            for r in self.waiting
            if r.deadline is not None and r.deadline <= now and r.first_scheduled is None
        ]

    def remove(self, request: Request) -> None:
        """Take a request out (finished, aborted, failed); frees its blocks. Idempotent."""
        if self._by_seq.pop(request.seq_id, None) is None:
            return
        self._constrained.pop(request.seq_id, None)
        self._release_history(request)
        self.blocks.free(request.seq_id)
        if request.status is Status.RUNNING:
            self._leave_running(request)
        else:
            self._leave_waiting(request)
        self._resume_admission_if_room()

    def _join_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_seq_key)
        queue = self._waiting_of.setdefault(account_of(request.tenant), [])
        bisect.insort(queue, request, key=_seq_key)

    def _leave_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        tenant = account_of(request.tenant)
        self._waiting_of[tenant].remove(request)
        if not self._waiting_of[tenant]:
            del self._waiting_of[tenant]

    def _join_running(self, request: Request) -> None:
        self.running.append(request)
        self._running_of[account_of(request.tenant)] += 1

    def _leave_running(self, request: Request) -> None:
        self.running.remove(request)
        tenant = account_of(request.tenant)
        self._running_of[tenant] -= 1
        if not self._running_of[tenant]:
            del self._running_of[tenant]

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- grammar masks (filled by the engine, off the loop) ------------------------------

    def unmasked(self) -> list[Request]:
        """Constrained sequences whose next mask is neither filled nor being filled, the
        running first, at most a step's worth."""
        lacking = [r for r in self._constrained.values() if r.grammar and r.grammar.needs_mask]
        lacking.sort(key=lambda r: r.status is not Status.RUNNING)
        return lacking[: self.max_num_seqs]

    def waits_for_masks(self) -> bool:
        """A running constrained sequence would sample next and has no mask yet."""
        return any(
            r.status is Status.RUNNING and r.remaining == 1 and r.grammar.mask is None
            for r in self._constrained.values()
            if r.grammar is not None
        )

    # ---- policy -----------------------------------------------------------------------

    def set_policy(self, policy: Policy) -> int:
        """Swap at the next iteration boundary; returns the first iteration it decides."""
        self._pending_policy = policy
        return self.iteration + 1

    @property
    def next_policy(self) -> Policy:
        """The policy that decides the next iteration."""
        return self._pending_policy or self.policy

    # ---- facts for the engine and the admin API ----------------------------------------

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            iteration=self.iteration,
            waiting=len(self.waiting),
            running=len(self.running),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_promised=self.blocks.num_promised,
            admission_paused=self.admission_paused,
            kv_blocks_cached=self.blocks.num_cached,
            kv_blocks_evictable=self.blocks.num_evictable,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            kv_blocks_evicted=self.blocks.num_evicted,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay with their sequences); returns
        how many blocks were cached."""
        return self.blocks.reset_cache()

    def queued_prompt_tokens(self) -> int:
        """Tokens the waiting sequences must compute before they can sample."""
        return sum(r.remaining for r in self.waiting)

    def predicted_prefill_ms(self, new_prompt: int = 0) -> float | None:
        """How long the prefill now pending (running prompts' rest, then the waiting) and a
        new prompt of `new_prompt` tokens would take at the measured step costs; None until
        the cost model is fitted. Chunking changes neither a prompt's tokens nor its
        attention pairs, only the number of steps, each of which also carries the decodes."""
        cost = self.step_cost.estimate()
        if cost is None:
            return None
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        prefills = [*prefilling, *self.waiting]
        work_ms = cost.chunk_ms(0, new_prompt) if new_prompt else 0.0
        work_ms += sum(cost.chunk_ms(r.num_computed_tokens, r.remaining) for r in prefills)
        tokens = new_prompt + sum(r.remaining for r in prefills)
        step_ms = cost.decode_ms([r.num_computed_tokens for r in decoding])
        steps = -(-tokens // max(1, self.max_batched_tokens - len(decoding)))
        return work_ms + steps * step_ms

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold (admission keeps the watermark free)."""
        blocks = self.blocks
        return blocks.tokens_fitting(blocks.num_blocks - blocks.watermark_blocks)

    @property
    def admission_watermark_blocks(self) -> int:
        return int(self.admission_watermark * self.blocks.num_blocks)

    def check_invariants(self) -> None:
        """Block accounting is exact, every block and promise belongs to a sequence it
        knows, and no request is preempted beyond the cap."""
        self.blocks.check_invariants()
        held = {seq_id for seq_id in self._by_seq if self.blocks.num_held(seq_id)}
        if None in self.blocks.windows:  # all-windowed tables may drop every block held
            computed = {r.seq_id for r in self.running if r.num_computed_tokens}
            assert held >= computed, "lost blocks"
        tables = [self.blocks.held(s) for s in self._by_seq]
        assert self.blocks.num_used == len({b for table in tables for b in table}), "stray block"
        windowed = any(self.blocks.windows)
        for r in self.running:
            owed = self.blocks.num_promised_to(r.seq_id)
            # a prefill is owed the rest of its prompt (a windowed group's up to its cap);
            # after it samples, nothing
            rest = self.blocks.extra_blocks(r.seq_id, r.num_tokens)
            assert owed == rest or (owed == 0 and r.remaining == 1) or (windowed and owed < rest), (
                f"sequence {r.seq_id}: promised {owed} blocks"
            )
        for r in self.running:
            first = r.num_computed_tokens // self.blocks.block_size
            written = [
                block
                for g in range(self.blocks.num_groups)
                for block in self.blocks.table(r.seq_id, g)[first:]
            ]
            assert all(self.blocks.refcount(b) == 1 for b in written), "a shared block is written"
            assert not any(map(self.blocks.is_cached, written)), "a cached block is written"
            assert r.num_computed_tokens < r.num_tokens or r.num_generated, "nothing to sample"
        running_promises = sum(self.blocks.num_promised_to(r.seq_id) for r in self.running)
        assert self.blocks.num_promised == running_promises, "a promise outlived its sequence"
        assert self.running or not self.admission_paused, "paused with nothing left to resume it"
        assert all(r.preemptions <= self.max_preemptions for r in self._by_seq.values())
        assert self._running_of == collections.Counter(account_of(r.tenant) for r in self.running)
        assert sum(map(len, self._waiting_of.values())) == len(self.waiting), "a lost waiter"

    def replace_blocks(self, blocks: BlockManager) -> None:
        """A restarted worker's fresh cache; only while nothing runs."""
        assert not self.running, "blocks replaced under running sequences"
        self.blocks = blocks
        self._last_step_ms = None
        self._released.clear()  # a new worker holds no history

    # ---- the iteration ----------------------------------------------------------------

    def schedule(self, now: float) -> ScheduleOutput:
        """Ask the policy, enforce the rules, allocate blocks, build the plan."""
        if self._pending_policy is not None:
            self.policy, self._pending_policy = self._pending_policy, None
        self.iteration += 1
        self._resume_admission_if_room()
        out = ScheduleOutput(iteration=self.iteration, policy=self.policy.name, plan=None)
        self._yield_slots(out)
        view = self.build_view(now)
        try:
            decision = self.policy.decide(view)
        except Exception:  # a broken policy must not stop the engine
            self.corrections["policy_raised"] += 1
            decision = Decision()
        self._apply(decision, out)
        if not out.scheduled and self.has_work():
            # A policy that schedules nothing while work is pending would stall everyone.
            self.corrections["empty_decision"] += 1
            self._apply(self._fallback_decision(), out)
        self._admit_wanted(out)
        self._add_drafts(out, decision.token_budget)
        for item in out.scheduled:
            if item.request.first_scheduled is None:
                item.request.first_scheduled = now
                out.started.append(item.request)
        if out.scheduled:
            out.plan = self._build_plan(out.scheduled, out.iteration)
        return out

    def update(self, out: ScheduleOutput, result: StepResult) -> list[Outcome]:
        """The step ran: commit progress, append sampled tokens, finish on EOS or length."""
        assert out.plan is not None
        error = self._result_error(out, result)
        if error is not None:
            return [self._fail(item.request, error) for item in out.scheduled]
        self._last_step_ms = result.step_ms
        self._last_step_tokens = out.plan.total_tokens
        drafted = [len(item.drafts) for item in out.scheduled]
        plan = out.plan
        self.step_cost.observe_plan(plan.num_tokens, plan.start_pos, result.step_ms, drafted)
        if self.speculator is not None:
            self.speculator.observe(plan.num_tokens, plan.start_pos, drafted, result.step_ms)
        taken = dict(zip(_sampled_ids(out), result.tokens, strict=True))
        outcomes = []
        for i, item in enumerate(out.scheduled):
            request = item.request
            if not request.is_finished:  # not aborted while the step ran
                if result.prompt_logprobs:
                    _keep_prompt_logprobs(request, result.prompt_logprobs[i])
                if result.pooled:
                    _keep_pooled(request, out.plan.start_pos[i], result.pooled[i])
                self._commit(item, out, taken.get(request.seq_id, []))
                self._register_blocks(request)
                self._drop_behind_window(request)
                if (
                    request.params.pooling is not None
                    and request.num_computed_tokens >= request.prompt_len
                ):
                    outcomes.append(self._pooled_outcome(request))
        self._observe_payoff(out, result.step_ms)
        sampled = [item.request for item in out.scheduled if item.samples]
        row = 0  # result.logprobs has a row per token, in the order of result.tokens
        for request, tokens in zip(sampled, result.tokens, strict=True):
            first, row = row, row + len(tokens)
            if request.is_finished:
                continue
            for offset, token in enumerate(tokens):
                logprobs = None
                if result.logprobs is not None and request.params.sampling.logprobs:
                    logprobs = _row(result.logprobs, first + offset)
                outcome = self._append(request, token, logprobs)
                outcomes.append(outcome)
                if outcome.finish is not None:
                    break
        return outcomes

    def _commit(self, item: Scheduled, out: ScheduleOutput, tokens: list[int]) -> None:
        """The step's tokens of `item` are computed: its own, and the drafts accepted (all
        but the last of the tokens it takes); the blocks past them are given back."""
        request, accepted = item.request, max(0, len(tokens) - 1)
        _sync_draft_model(item, accepted)
        request.num_computed_tokens += item.num_tokens + accepted
        if item.drafts:
            self.blocks.trim(request.seq_id, request.num_computed_tokens)
            out.accepted_tokens += accepted
            self.draft_tokens += len(item.drafts)
            self.accepted_tokens += accepted
        if item.samples and item.num_tokens == 1:  # a decode: drafts or not, its record
            request.acceptance.record(len(item.drafts), accepted)

    def _drop_behind_window(self, request: Request) -> None:
        """The next query of `request` is at its first uncomputed position: the blocks of
        windowed layers it no longer reads are released."""
        self.blocks.drop_behind_window(request.seq_id, request.num_computed_tokens)

    def _pooled_outcome(self, request: Request) -> Outcome:
        """A pooled request has computed its prompt: its embedding is done."""
        assert request.pooled is not None
        if request.params.pooling == MEAN_POOLING:
            request.pooled = [value / request.prompt_len for value in request.pooled]
        self.remove(request)
        return Outcome(request, finish=POOLED)

    def _register_blocks(self, request: Request) -> None:
        """Make the blocks `request` has filled and computed findable by later prompts."""
        if not self.blocks.enable_caching:
            return  # every step of every sequence: hash nothing nobody will look up
        hashes = self._hashes(request)
        self.blocks.register(request.seq_id, hashes, request.num_computed_tokens)

    def _prefix_hit(self, request: Request) -> PrefixHit:
        """The cached blocks a waiting request would start with; at least its last token
        is left to compute, since the step must produce the logits it samples from."""
        if not self.blocks.enable_caching or request.computes_whole_prompt:
            return self.blocks.no_hit
        hashes = self._hashes(request)
        return self.blocks.match(hashes[: (request.num_tokens - 1) // self.blocks.block_size])

    def _hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of `request`'s full blocks (computed once each)."""
        size, salt = self.blocks.block_size, request.params.cache_salt
        return chain_hashes(request.token_ids, size, request.block_hashes, salt)

    def build_view(self, now: float) -> View:
        blocks = self.blocks
        return View(
            iteration=self.iteration,
            now=now,
            running=tuple(self._seq_view(r) for r in self.running),
            waiting=tuple(self._waiting_view(r) for r in self.waiting[: self.waiting_view]),
            num_waiting=len(self.waiting),
            free_blocks=blocks.num_free,
            admit_blocks=0 if self.admission_paused else blocks.num_admittable,
            total_blocks=blocks.num_blocks,
            block_size=blocks.block_size,
            max_batched_tokens=self.max_batched_tokens,
            max_seqs=self.max_num_seqs,
            last_step_ms=self._last_step_ms,
            last_step_tokens=self._last_step_tokens,
            step_cost=self.step_cost.estimate(),
            kv_caps=blocks.caps,
        )

    def _seq_view(self, r: Request) -> SeqView:
        return SeqView(
            seq_id=r.seq_id,
            tenant=account_of(r.tenant),  # sub-tenants share their tenant's fair share
            priority=r.priority,
            arrival=r.received,
            prompt_len=r.prompt_len,
            num_generated=len(r.token_ids) - r.prompt_len,
            num_computed_tokens=r.num_computed_tokens,
            num_blocks=self.blocks.num_held(r.seq_id),
            preempted=r.preemptions,
            deadline=r.deadline if r.first_scheduled is None else None,
            num_cached_tokens=r.num_cached_tokens,
        )

    def _waiting_view(self, r: Request) -> SeqView:
        """As admission would take it: its cache hit computed already, the hit blocks that
        others hold counted as its own (they cost it nothing)."""
        hit = self._prefix_hit(r)
        hit_tokens = hit.num_blocks * self.blocks.block_size
        return dataclasses.replace(
            self._seq_view(r),
            num_computed_tokens=hit_tokens,
            num_blocks=self.blocks.blocks_to_hold(r.num_tokens)
            - self.blocks.admission_cost(r.num_tokens, hit),
            num_cached_tokens=min(hit_tokens, r.prompt_len),
            waiting=True,
        )

    # ---- results ----------------------------------------------------------------------

    def _result_error(self, out: ScheduleOutput, result: StepResult) -> str | None:
        if result.error is not None:
            return result.error
        expected = _sampled_ids(out)
        if result.seq_ids != expected or len(result.tokens) != len(expected):
            return f"step {out.iteration}: the worker returned tokens for other sequences"
        sampled = (item for item in out.scheduled if item.samples)
        for item, tokens in zip(sampled, result.tokens, strict=True):
            j = len(tokens) - 1  # the drafts it accepted, then the token sampled after them
            chosen = item.drafts[:j] if DRAFT_MODEL_TOKEN not in item.drafts else tokens[:j]
            if not 0 <= j <= len(item.drafts) or tokens[:j] != chosen:
                return f"step {out.iteration}: the worker took tokens its drafts do not allow"
        return None

    def _fail(self, request: Request, error: str) -> Outcome:
        self.remove(request)
        return Outcome(request, finish=("error", "worker_error"), error=error)

    def _append(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> Outcome:
        grammar = request.grammar
        if grammar is not None and not grammar.accept(token):  # the worker ignored the mask
            self.remove(request)
            error = f"the worker sampled token {token}, which response_format does not allow"
            return Outcome(request, finish=("error", "grammar_rejected"), error=error)
        request.token_ids.append(token)
        outcome = Outcome(request, token=token, logprobs=logprobs)
        assert request.params.max_tokens is not None  # validation fills it
        if token in self.eos_token_ids and not request.params.ignore_eos:
            outcome.finish = ("stop", "eos")
        elif token in request.params.stop_token_ids:
            outcome.finish = STOP_TOKEN
        elif grammar is not None and grammar.is_terminated:
            # the grammar took its end token: nothing may follow, even with ignore_eos
            outcome.finish = ("stop", "eos")
        elif request.num_generated >= request.params.max_tokens:
            outcome.finish = ("length", "max_tokens")
        if outcome.finish is not None:
            self.remove(request)
        return outcome

    # ---- validation of a decision -------------------------------------------------------

    def _apply(self, decision: Decision, out: ScheduleOutput) -> None:
        draft = _Draft(
            out,
            victims=self._policy_victims(decision),
            chosen={s.request.seq_id for s in out.scheduled},
            budget=self.max_batched_tokens - sum(s.num_tokens for s in out.scheduled),
        )
        for entry in decision.schedule:
            picked = self._pick(entry, draft)
            if picked is None:
                continue
            request, tokens = picked
            if request.status is Status.WAITING:
                # admitted first: its cache hit decides how many tokens are left to compute
                if tokens < 1 or draft.budget < 1:
                    self.corrections["nonpositive_tokens" if tokens < 1 else "token_budget"] += 1
                    continue
                if not self._admit(request, draft):
                    continue
                tokens = self._masked_tokens(request, self._legal_tokens(request, tokens, draft))
                if tokens < 1:
                    continue
            else:
                tokens = self._masked_tokens(request, self._legal_tokens(request, tokens, draft))
                if tokens < 1 or not self._make_room(request, tokens, draft):
                    continue
            self._add_to_step(request, tokens, draft)

    def _pick(self, entry: object, draft: _Draft) -> tuple[Request, int] | None:
        """The request and token count of one decision entry, if the entry is acceptable."""
        try:
            given_seq, given_tokens = cast(tuple[Any, Any], entry)
            seq_id, tokens = int(given_seq), int(given_tokens)
        except (TypeError, ValueError):
            self.corrections["malformed_entry"] += 1
            return None
        request = self._by_seq.get(seq_id)
        if request is None:
            self.corrections["unknown_id"] += 1
            return None
        if seq_id in draft.chosen:
            self.corrections["duplicate_id"] += 1
            return None
        if request.status is Status.WAITING and any(p is request for p in draft.out.preempted):
            # preempted a moment ago to make room: it cannot come back in the same step
            self.corrections["scheduled_after_preempt"] += 1
            return None
        if len(draft.out.scheduled) >= self.max_num_seqs:
            self.corrections["max_seqs"] += 1
            return None
        return request, tokens

    def _legal_tokens(self, request: Request, tokens: int, draft: _Draft) -> int:
        remaining, budget = request.remaining, draft.budget
        if tokens < 1:
            self.corrections["nonpositive_tokens"] += 1
            return 0
        if tokens > remaining:
            # also covers a decoding sequence asked for more than its one token
            self.corrections["tokens_over_remaining"] += 1
            tokens = remaining
        if tokens > budget:
            self.corrections["token_budget"] += 1
            # a decode token cannot be split; a prefill chunk can be shortened
            tokens = budget if remaining > 1 and budget > 0 else 0
        return tokens

    def _masked_tokens(self, request: Request, tokens: int) -> int:
        """`tokens`, one fewer if they would sample a constrained row whose mask is not
        filled yet (a decode's one token: none)."""
        grammar = request.grammar
        if grammar is None or grammar.mask is not None or tokens < 1:
            return tokens
        if request.num_computed_tokens + tokens < request.num_tokens:
            return tokens  # a chunk that does not sample
        self.corrections["grammar_mask_pending"] += 1
        return tokens - 1

    def _make_room(self, request: Request, tokens: int, draft: _Draft) -> bool:
        if self._grow(request, tokens, draft):
            return True
        self.corrections["no_blocks"] += 1
        return False

    def _add_to_step(self, request: Request, tokens: int, draft: _Draft) -> None:
        self.blocks.allocate(request.seq_id, request.num_computed_tokens + tokens)
        ends_prompt = request.num_computed_tokens + tokens >= request.num_tokens
        samples = ends_prompt and request.params.pooling is None
        draft.out.scheduled.append(Scheduled(request, tokens, samples))
        draft.chosen.add(request.seq_id)
        draft.budget -= tokens
        if request.remaining == 1:
            draft.out.decode_seqs += 1
        else:
            draft.out.prefill_tokens += tokens

    # ---- drafts (speculative decoding; module docstring) --------------------------------

    def _add_drafts(self, out: ScheduleOutput, token_budget: int | None) -> None:
        """Drafted tokens for the step's decodes, within what the step leaves of the token
        budget (the engine's and the policy's) and of the time the cost model allows;
        the sequences whose drafts were accepted most first."""
        speculator = self.speculator
        if speculator is None:
            return
        decodes = [i for i in out.scheduled if _decodes(i) and may_draft(i.request)]
        if not decodes:
            return
        cap = self.max_batched_tokens
        if isinstance(token_budget, int):  # a policy's, however wrong
            cap = min(cap, token_budget)
        num_tokens = [item.num_tokens for item in out.scheduled]
        starts = [item.request.num_computed_tokens for item in out.scheduled]
        left = cap - sum(num_tokens)
        decodes.sort(key=lambda item: (-item.request.acceptance.rate, item.request.seq_id))
        proposals = self._self_paid_proposals(out, decodes)
        requests = [item.request for item in decodes]
        self_paid = speculator.self_paid(requests, proposals) if proposals else 0.0
        if not speculator.others_may_pay and not (
            self_paid and speculator.draft_model_pays(len(decodes))
        ):
            return
        allowance = speculator.allowance(self.step_cost, num_tokens, starts, left, self_paid)
        for index, item in enumerate(decodes):
            request = item.request
            if self_paid:  # the blocks earlier rows' drafts took are no longer free
                proposal = proposals[index][: self._draft_room(request)]
                drafted = speculator.take(request, allowance, proposal)
            else:
                drafted = speculator.draft(request, allowance, self._draft_room(request))
            item.draft_context, item.draft_start = drafted.context, drafted.context_start
            drafts = drafted.tokens
            if drafts:
                self.blocks.allocate(request.seq_id, request.num_computed_tokens + 1 + len(drafts))
                item.drafts = drafts
                out.drafting_seqs += 1
                out.draft_tokens += len(drafts)

    def _observe_payoff(self, out: ScheduleOutput, step_ms: float) -> None:
        """A step of decodes alone, each sampling: what its tokens cost (Payoff)."""
        if self.speculator is None or not all(_decodes(item) for item in out.scheduled):
            return
        drafted = any(item.drafts or item.draft_context for item in out.scheduled)
        self.speculator.observe_payoff(len(out.scheduled), drafted, out.accepted_tokens, step_ms)

    def _self_paid_proposals(
        self, out: ScheduleOutput, decodes: list[Scheduled]
    ) -> list[list[int]]:
        """Where the step is a few decodes that may all draft, each one's proposal (the
        lookups cost little there); [] otherwise."""
        speculator = self.speculator
        assert speculator is not None
        if len(decodes) != len(out.scheduled) or not speculator.self_paid_size(len(decodes)):
            return []
        proposals = []
        for item in decodes:
            k = speculator.wanted(item.request, self._draft_room(item.request))
            proposals.append(speculator.propose(item.request, k) if k else [])
        return proposals

    def _draft_room(self, request: Request) -> int:
        """The most drafts `request` may append whose blocks are free, unpromised and
        above the watermark: drafts never preempt, nor take what admission counts on."""
        assert self.speculator is not None
        blocks, start = self.blocks, request.num_computed_tokens + 1
        spare = max(0, blocks.num_admittable)
        room = self.speculator.config.num_speculative_tokens
        while room and blocks.extra_blocks(request.seq_id, start + room) > spare:
            room -= 1
        return room

    def _policy_victims(self, decision: Decision) -> list[Request]:
        victims: list[Request] = []
        seen: set[int] = set()
        for seq_id in decision.preempt:
            request = self._by_seq.get(seq_id) if isinstance(seq_id, int) else None
            if request is None or request.status is not Status.RUNNING or seq_id in seen:
                self.corrections["bad_preempt_id"] += 1
                continue
            seen.add(seq_id)
            if self._at_cap(request):
                self.corrections["preempt_cap"] += 1
                continue
            victims.append(request)
        return victims

    def _at_cap(self, request: Request) -> bool:
        return request.preemptions >= self.max_preemptions

    def _grow(self, request: Request, tokens: int, draft: _Draft) -> bool:
        """Blocks for a running sequence's next tokens: free ones, else victims'."""
        needed = request.num_computed_tokens + tokens
        short = self.blocks.extra_blocks(request.seq_id, needed) - self.blocks.num_free
        if short <= 0:
            return True
        victims = _first_enough(short, self._growth_victims(request, draft), self.blocks.num_held)
        if victims is None:
            return False
        for victim in victims:
            self._preempt(victim, draft.out)
        return True

    def _growth_victims(self, request: Request, draft: _Draft) -> list[Request]:
        """The policy's victims in its order, then the others by least progress lost."""
        named = self._named_victims(request, draft)
        taken = {r.seq_id for r in named} | draft.chosen
        others = [
            r
            for r in self.running
            if r is not request and r.seq_id not in taken and not self._at_cap(r)
        ]
        return named + sorted(others, key=_progress_lost)

    def _named_victims(self, request: Request, draft: _Draft) -> list[Request]:
        return [
            r
            for r in draft.victims
            if r is not request and r.status is Status.RUNNING and r.seq_id not in draft.chosen
        ]

    def _admit(self, request: Request, draft: _Draft) -> bool:
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
        if not self._leaves_wanted_slots(request):
            self.corrections["tenant_slots"] += 1
            return False
        if slot_victim is not None:  # a slot, not blocks: no reason to pause admission
            self._preempt(slot_victim, draft.out, pause=False)
        hit = self._prefix_hit(request)
        victims = self._admission_victims(request, hit, draft)
        if victims is None:
            self.corrections["admission_deferred"] += 1
            return False
        for victim in victims:
            self._preempt(victim, draft.out)
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
        self, request: Request, hit: PrefixHit, draft: _Draft
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

    def _preempt(self, victim: Request, out: ScheduleOutput, *, pause: bool = True) -> None:
        self.blocks.free(victim.seq_id)
        self._release_history(victim)
        self._leave_running(victim)
        victim.reset_for_recompute()
        self._join_waiting(victim)
        out.preempted.append(victim)
        self.admission_paused = self.admission_paused or pause

    def _release_history(self, request: Request) -> None:
        if request.history_on_worker:
            request.history_on_worker = False
            self._released.append(request.seq_id)

    # ---- tenants' slots (module docstring) ---------------------------------------------

    @property
    def tenant_slots(self) -> int:
        """The running slots a tenant may hold while another tenant below them waits."""
        return max(1, int(self.max_num_seqs * self.tenant_share))

    def _wanted_slots(self, but: str | None = None) -> dict[str, int]:
        """Slots each tenant (other than `but`) below its share wants for its waiting
        sequences, the tenant waiting longest first; empty without tenant quotas."""
        if self.tenant_share >= 1:
            return {}
        cap, wanted = self.tenant_slots, {}
        for tenant, queue in self._waiting_of.items():
            if tenant != but and self._running_of[tenant] < cap:
                wanted[tenant] = min(len(queue), cap - self._running_of[tenant])
        return dict(sorted(wanted.items(), key=lambda item: self._waiting_of[item[0]][0].seq_id))

    def _free_slots(self) -> int:
        return self.max_num_seqs - len(self.running)

    def _yield_slots(self, out: ScheduleOutput) -> None:
        """Preempt sequences of tenants past their share until the free slots cover what
        the tenants below theirs want. Not a block shortage: admission is not paused."""
        if self.admission_paused:
            return  # nobody could take the slot
        short = sum(self._wanted_slots().values()) - self._free_slots()
        for _ in range(short):
            victim = self._slot_victim()
            if victim is None:
                return
            self._preempt(victim, out, pause=False)
            self.corrections["tenant_slots_preempted"] += 1

    def _slot_victim(self) -> Request | None:
        """The running sequence of a tenant past its share whose preemption loses least."""
        cap = self.tenant_slots
        over = [
            r
            for r in self.running
            if self._running_of[account_of(r.tenant)] > cap and not self._at_cap(r)
        ]
        return min(over, key=_progress_lost, default=None)

    def _leaves_wanted_slots(self, request: Request) -> bool:
        """Whether admitting `request` leaves the slots other tenants below their share
        want: at its share, a tenant takes only slots nobody else waits for."""
        tenant = account_of(request.tenant)
        if self.tenant_share >= 1 or self._running_of[tenant] < self.tenant_slots:
            return True
        return self._free_slots() > sum(self._wanted_slots(but=tenant).values())

    def _admit_wanted(self, out: ScheduleOutput) -> None:
        """Admit the sequences tenants below their share want that the policy left
        waiting, in each tenant's arrival order, as many as the free slots hold."""
        schedule: list[tuple[int, int]] = []
        free = self._free_slots()
        for tenant, count in self._wanted_slots().items():
            taken = self._waiting_of[tenant][: max(0, min(count, free - len(schedule)))]
            schedule += [(r.seq_id, r.remaining) for r in taken]
        if not schedule:
            return
        before = len(out.scheduled)
        self._apply(Decision(schedule=schedule), out)
        self.corrections["tenant_slots_given"] += len(out.scheduled) - before

    def _resume_admission_if_room(self) -> None:
        """The end of the pause a preemption began: enough blocks are back (hysteresis)."""
        if self.blocks.num_available > self.admission_watermark_blocks:
            self.admission_paused = False

    def _fallback_decision(self) -> Decision:
        """Running sequences first, then waiting ones, as much of each as fits."""
        schedule = [(r.seq_id, r.remaining) for r in self.running]
        schedule += [(r.seq_id, r.remaining) for r in self.waiting]
        return Decision(schedule=schedule)

    # ---- plan -------------------------------------------------------------------------

    def _build_plan(self, scheduled: list[Scheduled], step_id: int) -> BatchPlan:
        seq_ids, num_tokens, start_pos, input_ids = [], [], [], []
        tables, sample, sampling, bitmasks = [], [], [], []
        prompt_targets: list[list[int] | None] = []
        histories: list[History | None] = []
        pooling: list[str | None] = []
        drafts: list[list[int]] = []
        draft_context: list[list[int]] = []
        draft_start: list[int] = []
        table_of = self.blocks.table
        groups = range(1, self.blocks.num_groups)  # a hybrid model's: the plan's group_tables
        group_tables: list[list[list[int]]] = []
        for item in scheduled:
            request = item.request
            start = request.num_computed_tokens
            seq_ids.append(request.seq_id)
            num_tokens.append(item.chunk)
            start_pos.append(start)
            input_ids.extend(request.token_ids[start : start + item.num_tokens])
            input_ids.extend(item.drafts)
            drafts.append(item.drafts)
            draft_context.append(item.draft_context)
            draft_start.append(item.draft_start)
            tables.append(list(table_of(request.seq_id)))
            if groups:
                group_tables.append([list(table_of(request.seq_id, g)) for g in groups])
            sample.append(item.samples)
            sampling.append(request.params.sampling)
            prompt_targets.append(_prompt_targets(request, item.num_tokens))
            grammar = request.grammar if item.samples else None
            bitmasks.append(None if grammar is None else grammar.mask)
            histories.append(_history(request, start))
            pooling.append(_pooling(request, item.num_tokens))
        released, self._released = self._released, []
        return BatchPlan(
            step_id=step_id,
            seq_ids=seq_ids,
            num_tokens=num_tokens,
            start_pos=start_pos,
            input_ids=input_ids,
            block_tables=tables,
            group_tables=group_tables,
            sample=sample,
            sampling=sampling,
            prompt_targets=prompt_targets if any(prompt_targets) else [],
            token_bitmasks=bitmasks if any(m is not None for m in bitmasks) else [],
            histories=histories if any(h is not None for h in histories) else [],
            released=released,
            pooling=pooling if any(p is not None for p in pooling) else [],
            draft_tokens=drafts if any(drafts) else [],
            draft_context=draft_context if any(draft_context) else [],
            draft_start=draft_start if any(draft_context) else [],
        )


def _sync_draft_model(item: Scheduled, accepted: int) -> None:
    """What the draft model's cache holds once the step ran: the context sent, and the
    rows it drafted from that the sequence keeps (gpu_worker.draft_model)."""
    request = item.request
    if item.drafts and item.drafts[0] == DRAFT_MODEL_TOKEN:
        kept = min(accepted, len(item.drafts) - 1)
        request.draft_synced = request.num_computed_tokens + 1 + kept
    elif item.draft_context:
        request.draft_synced = item.draft_start + len(item.draft_context)


def _sampled_ids(out: ScheduleOutput) -> list[int]:
    return [item.request.seq_id for item in out.scheduled if item.samples]


def _decodes(item: Scheduled) -> bool:
    """A step's row computes one token and samples after it: it may draft."""
    return item.samples and item.num_tokens == 1


def _pooling(request: Request, num_tokens: int) -> str | None:
    """What the worker pools of a chunk (BatchPlan.pooling): every chunk's rows for a mean,
    the last row of the chunk that ends the prompt for the last token's state."""
    kind = request.params.pooling
    if kind is None:
        return None
    if kind == MEAN_POOLING:
        return POOL_SUM
    ends_prompt = request.num_computed_tokens + num_tokens >= request.prompt_len
    return POOL_LAST if ends_prompt else None


def _keep_pooled(request: Request, start: int, found: str | None) -> None:
    """Adds a chunk's pooled vector to what `request` has. A mean pooled request takes no
    prefix-cache hit, so its computation (again, after a preemption) starts at 0."""
    if found is None:
        return
    vector = np.frombuffer(base64.b64decode(found), dtype="<f8")
    if start == 0 or request.pooled is None or request.params.pooling != MEAN_POOLING:
        request.pooled = vector.tolist()
    else:
        request.pooled = (np.asarray(request.pooled) + vector).tolist()


def _history(request: Request, start: int) -> History | None:
    """The History a plan begins `request`'s with, if the worker has none yet and it reads one."""
    if request.history_on_worker or not request.params.sampling.reads_history:
        return None
    request.history_on_worker = True
    return History(request.prompt_len, request.token_ids[:start])


def _prompt_targets(request: Request, num_tokens: int) -> list[int] | None:
    """The prompt tokens a chunk's positions predict, when the request wants them."""
    if not request.needs_prompt_logprobs:
        return None
    start = request.num_computed_tokens
    return request.token_ids[start + 1 : min(start + 1 + num_tokens, request.prompt_len)] or None


def _keep_prompt_logprobs(request: Request, found: TokenLogprobs | None) -> None:
    """Adds a chunk's prompt log-probabilities to what `request` has, once each: a request
    recomputed after a preemption computes some again."""
    if found is None or request.prompt_logprobs is None:
        return
    first = request.num_computed_tokens  # the target of the chunk's first position, minus 1
    known = len(request.prompt_logprobs)
    if first > known:
        return  # cannot happen: such a request takes no prefix-cache hit
    skip = known - first
    request.prompt_logprobs.extend(
        TokenLogprobs(found.logprobs[skip:], found.top_ids[skip:], found.top_logprobs[skip:])
    )


def _row(logprobs: TokenLogprobs, i: int) -> TokenLogprobs:
    return TokenLogprobs(
        logprobs.logprobs[i : i + 1], logprobs.top_ids[i : i + 1], logprobs.top_logprobs[i : i + 1]
    )
