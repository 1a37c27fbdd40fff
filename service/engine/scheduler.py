"""The owner of the iteration: `schedule()` decides a step, `update()` applies its result.

schedule(): view -> policy decision -> core validation -> blocks -> step plan (written by
service.engine.plan's PlanBuilder, the mirror of what the worker holds). The policy
proposes; this module disposes. Whatever the decision says, a step never holds more than
`max_batched_tokens` tokens or `max_num_seqs` sequences, a decoding sequence computes
exactly one token, a prefill chunk never runs past its sequence, and blocks come from free
ones only. Every fix is counted in `corrections` so tests can see it. Blocks go as
service.engine.block_rules says: whom admission takes, how a running sequence grows, whom
either preempts (and tenants' slots); a waiting sequence starts from its cached prefix
(service.engine.prefix_cache).

LoRA adapters (--enable-lora, service.engine.adapters). A waiting sequence with an adapter
is admitted only once a slot holds it (a free one, or the least recently used one no
running, transferring or joining sequence uses); the plan loads it (StepPlan.adapters)
before the sequence is introduced. Otherwise it waits, counted as `adapter_slots_busy`.

update(): the scheduled tokens are now cached; each sampled token is appended; EOS, a
stop_token_ids token and max_tokens finish a sequence and free its blocks. A request with
a grammar (structured output) sends the tokens it allows with each plan that samples it,
and its grammar takes each token appended; a grammar that has taken its end token
finishes it too. The engine fills those masks off the loop (service.engine.masks): a
constrained row whose mask is not filled yet does not sample (a decode sits the step out,
a prefill chunk stops a token short; counted as `grammar_mask_pending`). Text
(detokenization, stop strings) and streams are the engine's business, which is what keeps
this module free of I/O: a whole iteration runs without trio or a worker.

Sliding windows. The blocks of layers that attend within a window (every layer of a
Mistral; 15 of 18 layers of Gemma 3 270M, a KV group of their own: BlockManager) are
released by update() once wholly behind a sequence's window (drop_behind_window), so such
a group holds about window / block_size blocks of a long sequence. Admission counts what a
prompt holds at its peak: all its blocks in a full group, a windowed group's up to its cap
(the window's blocks and a chunk's), so a prompt longer than the cache may still fit on a
model whose every layer is windowed.

Speculative decoding (--speculative-config). Once the decision is applied, each decoding
sequence may append drafted tokens to its one token (service.engine.speculation: what is
drafted, and from which tokens and blocks of the step). The worker accepts j of a sequence's
k drafts and samples one token after them: update() counts 1 + j tokens computed, gives back
the blocks past them (BlockManager.trim: between steps a sequence holds the blocks of its
computed tokens, drafts or not), and appends the tokens one by one, any of which may finish
it (EOS, a stop token, max_tokens: the rest are dropped). A block is registered in the
prefix cache only once its positions are computed and their tokens appended, so a block that
held a rejected draft's K/V is never found as if it held the token that replaced it.

Pooling (embeddings). A pooled request never samples: the worker pools its chunks
(NewSeq.pooling), and update() finishes it (POOLED) with the step that
computes its prompt's last token. A mean-pooled one takes no prefix-cache hit, since every
row's state is summed, so its sum starts again at 0 after a preemption.

Prefill and decode on two servers (--kv-transfer-role, service.engine.kv_transfer). A
producer's do_remote_decode request that ends by its own tokens keeps its blocks under a
hold (kv_holds) until a step's notices release it or schedule() finds it expired. A
consumer's request with the producer's K/V waits in kv_pulls, never in a policy's view:
schedule() gives it blocks for its prompt and a KvPull in the plan (rowless plans while
only K/V moves), update() takes the worker's PullDone and makes it a running sequence with
all but the prompt's last token computed, or fails it kv_transfer_failed. With a staging
arena (kv_staging), the plan of the step that ends a held-to-be request (its one token
sampled at max_tokens) carries a KvStage: the worker gathers the prompt into the arena
before the result comes back, and the region stays the hold's until the hold ends (or is
freed with a request that ends otherwise).
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from typing import Any, cast

from gpu_worker.protocol import DRAFT_MODEL_TOKEN, KvStage, PullDone, StepResult, TokenLogprobs
from policies.base import Decision, Policy, View
from service.engine.adapters import AdapterSlots
from service.engine.block_manager import BlockManager
from service.engine.block_rules import BlockRules
from service.engine.kv_pulls import KvPulls
from service.engine.kv_transfer import (
    KV_TRANSFER_FAILED,
    KvHold,
    KvHolds,
    StagingArena,
    handover_position,
)
from service.engine.plan import PlanBuilder
from service.engine.prefix_cache import prefix_hit, register_blocks
from service.engine.request import MEAN_POOLING, Request, Status
from service.engine.speculation import Speculator
from service.engine.step import (
    POOLED,
    STOP_TOKEN,
    Outcome,
    Scheduled,
    ScheduleOutput,
    SchedulerStats,
    StepDraft,
)
from service.engine.step_cost import StepCostModel
from service.engine.tenants import TenantSlots
from service.engine.views import seq_view, waiting_view


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
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting_view = waiting_view  # policies see this many of the waiting, in order
        self.running: list[Request] = []  # admission order
        self.waiting: list[Request] = []  # arrival order (seq_id)
        self.tenants = TenantSlots(max_num_seqs, tenant_share)
        self.corrections: collections.Counter[str] = collections.Counter()
        self.iteration = 0  # the last one scheduled
        self._pending_policy: Policy | None = None
        self._by_seq: dict[int, Request] = {}
        # a request's later sequences (n > 1), by its first's id, until the first has
        # computed the prompt they share: they then find it in the prefix cache
        self._held: dict[str, list[Request]] = {}
        self._constrained: dict[int, Request] = {}  # those with a grammar, by seq_id
        self.plans = PlanBuilder(blocks)  # what the worker holds; the steps' plans
        self.rules = BlockRules(
            blocks,
            (self.running, self.waiting),
            self.tenants,
            self.plans,
            self.corrections,
            max_num_seqs=max_num_seqs,
            max_preemptions=max_preemptions,
            admission_watermark=admission_watermark,
        )
        self._last_step_ms: float | None = None
        self._last_step_tokens = 0
        self.step_cost = StepCostModel()  # fitted to every step's measured time
        self.speculator = speculator  # None: nothing is drafted
        self.draft_tokens = 0  # verified since the start
        self.accepted_tokens = 0
        # disaggregated prefill and decode (module docstring): a producer's holds, and a
        # consumer's requests on their way in (kv_pulls)
        self.kv_holds: KvHolds | None = None
        self.kv_staging: StagingArena | None = None  # a producer's, when its worker has one
        self._forgotten: list[str] = []  # expired holds' ids, for the next plan (StepPlan)
        self.kv_pulls = KvPulls()
        self.now = 0.0  # the engine clock at the last schedule()
        # LoRA (--enable-lora): the worker's adapter slots, filled as admission needs them
        self.adapter_slots: AdapterSlots | None = None

    # ---- membership -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._by_seq[request.seq_id] = request
        if request.grammar is not None:
            self._constrained[request.seq_id] = request
        if request.params.remote_kv is not None:
            self.kv_pulls.waiting.append(request)  # no policy sees it before its K/V is in
        else:
            self.rules.join_waiting(request)

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
        """Sequences waiting to start: the held ones too, and a consumer's on their way in."""
        held = sum(len(siblings) for siblings in self._held.values())
        return len(self.waiting) + held + self.kv_pulls.queued

    def expired(self, now: float) -> list[Request]:
        """Waiting requests whose deadline to start has passed (the engine ends them): a
        consumer's waiting for blocks to pull into, or pulled, too."""
        pulls = self.kv_pulls
        return [
            r
            for r in [*self.waiting, *pulls.waiting, *pulls.pulled]
            if r.deadline is not None and r.deadline <= now and r.first_scheduled is None
        ]

    def remove(self, request: Request) -> None:
        """Take a request out (finished, aborted, failed); frees its blocks. Idempotent."""
        if self._by_seq.pop(request.seq_id, None) is None:
            return
        self._constrained.pop(request.seq_id, None)
        self.plans.forget(request.seq_id)
        if request.params.remote_kv is not None and request.status is not Status.RUNNING:
            if self.kv_pulls.leave(request):  # else a pull still writes its blocks
                self.blocks.free(request.seq_id)
            return
        if request.kv_hold is None:  # a held request's blocks are freed when its hold ends
            self.blocks.free(request.seq_id)
            if self.kv_staging is not None:
                self.kv_staging.free(request.seq_id)
        self.rules.leave(request)

    def _retire(self, request: Request) -> None:
        """`request` ended by its own tokens: a producer holds a do_remote_decode one's
        blocks for the consumer (kv_transfer.KvHolds) before it leaves."""
        if (
            self.kv_holds is not None
            and request.params.remote_decode
            and request.num_computed_tokens >= request.prompt_len
        ):
            arena, seq_id = self.kv_staging, request.seq_id
            staged_at = None if arena is None else arena.first_block(seq_id)
            blocks = self._handover_blocks(request)
            request.kv_hold = self.kv_holds.hold(
                seq_id, blocks, request.prompt_len, self.now, staged_at
            )
        self.remove(request)

    def _handover_blocks(self, request: Request) -> list[list[int]]:
        """Per KV group, the blocks of a do_remote_decode request's prompt that a consumer
        reads (kv_transfer.handover_position): its hold's, and its staged region's, group
        after group."""
        position = handover_position(request.prompt_len, self.blocks.block_size)
        return self.blocks.reading_tables(request.seq_id, request.prompt_len, position)

    def _stages(self, scheduled: list[Scheduled]) -> list[KvStage]:
        """Regions of the staging arena for the prompts of do_remote_decode requests this
        step ends (it samples their last token), which the worker gathers before its result
        comes back; a prompt that finds no room is held unstaged."""
        arena = self.kv_staging
        if arena is None or not arena.blocks:
            return []
        stages = []
        for item in scheduled:
            request = item.request
            assert request.params.max_tokens is not None  # validation fills it
            ends = item.samples and request.num_generated + 1 >= request.params.max_tokens
            if request.params.remote_decode and ends:
                blocks = [b for group in self._handover_blocks(request) for b in group]
                first = arena.take(request.seq_id, len(blocks))
                if first is not None:
                    stages.append(KvStage(blocks, first))
        return stages

    @property
    def transferring(self) -> list[Request]:
        """Requests whose K/V is being pulled or was: a dead worker's cache lost it."""
        return [*self.kv_pulls.pulling.values(), *self.kv_pulls.pulled]

    @property
    def kv_owners(self) -> set[int]:
        """Sequences that left but whose blocks are still held: by a producer's hold, or
        under a pull still writing them."""
        held = self.kv_holds.seq_ids if self.kv_holds is not None else set()
        return held | self.kv_pulls.ended_mid_pull(self._by_seq)

    @property
    def sequences(self) -> Collection[Request]:
        """Every sequence it holds, waiting or running."""
        return self._by_seq.values()

    @property
    def constrained(self) -> Collection[Request]:
        """The sequences it holds that have a grammar (their masks: service.engine.masks)."""
        return self._constrained.values()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.transfers_pending)

    @property
    def transfers_pending(self) -> bool:
        """K/V on the move: steps go on (rowless if need be) to hear how it ends."""
        holding = self.kv_holds is not None and bool(self.kv_holds.by_id)
        return self.kv_pulls.pending or holding

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
            admission_paused=self.rules.admission_paused,
            kv_blocks_cached=self.blocks.num_cached,
            kv_blocks_evictable=self.blocks.num_evictable,
            prefix_queries=self.rules.prefix_queries,
            prefix_hits=self.rules.prefix_hits,
            kv_blocks_evicted=self.blocks.num_evicted,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay with their sequences); returns
        how many blocks were cached."""
        return self.blocks.reset_cache()

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold (admission keeps the watermark free)."""
        blocks = self.blocks
        return blocks.tokens_fitting(blocks.num_blocks - blocks.watermark_blocks)

    def replace_blocks(self, blocks: BlockManager) -> None:
        """A restarted worker's fresh cache; only while nothing runs."""
        assert not self.running, "blocks replaced under running sequences"
        assert not self.kv_pulls.pulled, "blocks replaced under pulled sequences"
        self.kv_pulls.forget_pulls()  # their requests ended with the old worker
        if self.kv_holds is not None:  # the held blocks went with the old cache
            self.kv_holds.expire(float("inf"))
        self._forgotten.clear()  # and the new worker tallied nothing
        self.blocks = self.rules.blocks = blocks
        self._last_step_ms = None
        self.plans.reset(blocks)
        if self.adapter_slots is not None:  # the new worker holds no adapter
            self.adapter_slots.reset()

    # ---- the iteration ----------------------------------------------------------------

    def schedule(self, now: float) -> ScheduleOutput:
        """Ask the policy, enforce the rules, allocate blocks, build the plan."""
        if self._pending_policy is not None:
            self.policy, self._pending_policy = self._pending_policy, None
        self.iteration += 1
        self.now = now
        self._end_expired_holds(now)
        self._run_received()
        self.rules.resume_admission_if_room()
        out = ScheduleOutput(iteration=self.iteration, policy=self.policy.name, plan=None)
        self.rules.yield_slots(out)
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
        pulls = self.kv_pulls.start(self.blocks, now)
        if out.scheduled or self.transfers_pending:
            out.plan = self.plans.build(out.scheduled, out.iteration)
            out.plan.pulls = pulls
            out.plan.transfer_news = self.transfers_pending
            out.plan.stages = self._stages(out.scheduled)
            out.plan.forgotten, self._forgotten = self._forgotten, []
            if self.adapter_slots is not None:
                out.plan.adapters = self.adapter_slots.take_loads()
            out.written = [self._written(item) for item in out.scheduled]
        return out

    def _take_transfers(self, result: StepResult) -> list[Outcome]:
        """A step's news of K/V transfers: the consumers' notices end holds; pulls done."""
        if self.kv_holds is not None:
            self.kv_holds.keep_reading(result.reading, self.now)
            self._end_holds(self.kv_holds.release(result.notices))
        return [o for done in result.pulls_done if (o := self._pulled(done)) is not None]

    def _pulled(self, done: PullDone) -> Outcome | None:
        """A pull ended: its request computes the prompt's last token next, or fails
        (never recomputed: vLLM's rule); an aborted one's blocks are freed now."""
        request = self.kv_pulls.finish(done.transfer_id)
        if request is None:
            return None
        if request.seq_id not in self._by_seq:  # it ended while its blocks were written
            self.blocks.free(request.seq_id)
            return None
        if done.error is not None:
            self.remove(request)
            error = f"pulling the prompt's K/V from its producer failed: {done.error}"
            return Outcome(request, finish=("error", KV_TRANSFER_FAILED), error=error)
        request.num_computed_tokens = request.prompt_len - 1
        request.status = Status.WAITING
        register_blocks(self.blocks, request)
        self.kv_pulls.pulled.append(request)
        return None

    def overdue_pulls(self, now: float, timeout: float) -> list[Request]:
        """Requests whose pull began `timeout` s ago or more and is not done (the engine
        ends them; their blocks stay theirs until the worker reports the pull done)."""
        return [r for r in self.kv_pulls.overdue(now, timeout) if r.seq_id in self._by_seq]

    def _run_received(self) -> None:
        """Pulled requests join the running while there are slots (and their adapters'
        slots: one whose adapter finds every slot busy stays pulled)."""
        pulled = self.kv_pulls.pulled
        for request in list(pulled):
            if len(self.running) >= self.max_num_seqs:
                break
            if self._adapter_slot(request, []):
                pulled.remove(request)
                self.rules.join_received(request)

    def _end_expired_holds(self, now: float) -> None:
        if self.kv_holds is not None:
            expired = self.kv_holds.expire(now)
            self._end_holds(expired)
            self._forgotten += [hold.transfer_id for hold in expired]

    def _end_holds(self, holds: list[KvHold]) -> None:
        """Ended holds give back their blocks and staging regions."""
        for hold in holds:
            self.blocks.free(hold.seq_id)
            if self.kv_staging is not None:
                self.kv_staging.free(hold.seq_id)

    def _written(self, item: Scheduled) -> list[int]:
        """The blocks of group 0 a row writes, from its first position on, as sent: the
        engine's debug check (invariants.check_blocks_kept) reads them after a free."""
        first = item.start // self.blocks.block_size
        return self.blocks.table(item.request.seq_id)[first:]

    def update(self, out: ScheduleOutput, result: StepResult) -> list[Outcome]:
        """The step ran: commit progress, append sampled tokens, finish on EOS or length."""
        assert out.plan is not None
        transfers = self._take_transfers(result)
        error = self._result_error(out, result)
        if error is not None:
            return transfers + [self._fail(item.request, error) for item in out.scheduled]
        if not out.scheduled:
            return transfers  # a step that only moved K/V: no cost to learn from
        self._last_step_ms = result.step_ms
        self._last_step_tokens = out.plan.total_tokens
        drafted = [len(item.drafts) for item in out.scheduled]
        num_tokens, start_pos = out.plan.num_tokens, out.plan.start_pos
        self.step_cost.observe_plan(num_tokens, start_pos, result.step_ms, drafted)
        if self.speculator is not None:
            self.speculator.observe(num_tokens, start_pos, drafted, result.step_ms)
        taken = dict(zip(out.sampled_ids(), result.tokens, strict=True))
        outcomes = []
        for i, item in enumerate(out.scheduled):
            request = item.request
            if not request.is_finished:  # not aborted while the step ran
                accepted = self._commit(item, out, taken.get(request.seq_id, []))
                self.plans.fold(item, i, result, accepted)
                register_blocks(self.blocks, request)
                self._drop_behind_window(request)
                if (
                    request.params.pooling is not None
                    and request.num_computed_tokens >= request.prompt_len
                ):
                    outcomes.append(self._pooled_outcome(request))
        self._observe_payoff(out, result.step_ms)
        outcomes += transfers
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

    def _commit(self, item: Scheduled, out: ScheduleOutput, tokens: list[int]) -> int:
        """The step's tokens of `item` are computed: its own, and the drafts accepted (all
        but the last of the tokens it takes); the blocks past them are given back. Returns
        how many drafts it accepted."""
        request, accepted = item.request, max(0, len(tokens) - 1)
        request.num_computed_tokens += item.num_tokens + accepted
        if item.drafts:
            self.blocks.trim(request.seq_id, request.num_computed_tokens)
            out.accepted_tokens += accepted
            self.draft_tokens += len(item.drafts)
            self.accepted_tokens += accepted
        if item.samples and item.num_tokens == 1:  # a decode: drafts or not, its record
            request.acceptance.record(len(item.drafts), accepted)
        return accepted

    def _drop_behind_window(self, request: Request) -> None:
        """The next query of `request` is at its first uncomputed position: the blocks of
        windowed layers it no longer reads are released; a do_remote_decode request's
        only up to the handover's position, whose window its consumer reads."""
        position = request.num_computed_tokens
        if request.params.remote_decode:
            handover = handover_position(request.prompt_len, self.blocks.block_size)
            position = min(position, handover)
        self.blocks.drop_behind_window(request.seq_id, position)

    def _pooled_outcome(self, request: Request) -> Outcome:
        """A pooled request has computed its prompt: its embedding is done."""
        assert request.pooled is not None
        if request.params.pooling == MEAN_POOLING:
            request.pooled = [value / request.prompt_len for value in request.pooled]
        self.remove(request)
        return Outcome(request, finish=POOLED)

    def build_view(self, now: float) -> View:
        """What the policy decides from (service.engine.views)."""
        blocks = self.blocks
        waiting = self.waiting[: self.waiting_view]
        return View(
            iteration=self.iteration,
            now=now,
            running=tuple(seq_view(r, blocks) for r in self.running),
            waiting=tuple(waiting_view(r, blocks, prefix_hit(blocks, r)) for r in waiting),
            num_waiting=len(self.waiting),
            free_blocks=blocks.num_free,
            admit_blocks=0 if self.rules.admission_paused else blocks.num_admittable,
            total_blocks=blocks.num_blocks,
            block_size=blocks.block_size,
            max_batched_tokens=self.max_batched_tokens,
            max_seqs=self.max_num_seqs,
            last_step_ms=self._last_step_ms,
            last_step_tokens=self._last_step_tokens,
            step_cost=self.step_cost.estimate(),
            kv_caps=blocks.caps,
        )

    # ---- results ----------------------------------------------------------------------

    def _result_error(self, out: ScheduleOutput, result: StepResult) -> str | None:
        if result.error is not None:
            return result.error
        expected = out.sampled_ids()
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
            self._retire(request)
        return outcome

    # ---- validation of a decision -------------------------------------------------------

    def _apply(self, decision: Decision, out: ScheduleOutput) -> None:
        draft = StepDraft(
            out,
            victims=self.rules.policy_victims(decision),
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
                joining = [item.request for item in draft.out.scheduled]
                if not self._adapter_slot(request, joining) or not self.rules.admit(request, draft):
                    continue
                tokens = self._masked_tokens(request, self._legal_tokens(request, tokens, draft))
                if tokens < 1:
                    continue
            else:
                tokens = self._masked_tokens(request, self._legal_tokens(request, tokens, draft))
                if tokens < 1 or not self.rules.make_room(request, tokens, draft):
                    continue
            self._add_to_step(request, tokens, draft)

    def _pick(self, entry: object, draft: StepDraft) -> tuple[Request, int] | None:
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

    def _adapter_slot(self, request: Request, joining: list[Request]) -> bool:
        """Whether a slot holds the adapter of `request`, which is being admitted beside
        `joining` (loaded by this step's plan if need be); False: every slot is busy with
        adapters that running, transferring or joining sequences use, and it waits."""
        name, path = request.params.adapter, request.params.adapter_path
        if name is None or path is None or self.adapter_slots is None:
            return True
        users = (*self.running, *self.transferring, *joining)
        in_use = [r.params.adapter for r in users if r is not request]
        if self.adapter_slots.acquire(name, path, filter(None, in_use)):
            return True
        self.corrections["adapter_slots_busy"] += 1
        return False

    def _legal_tokens(self, request: Request, tokens: int, draft: StepDraft) -> int:
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

    def _add_to_step(self, request: Request, tokens: int, draft: StepDraft) -> None:
        self.blocks.allocate(request.seq_id, request.num_computed_tokens + tokens)
        ends_prompt = request.num_computed_tokens + tokens >= request.num_tokens
        samples = ends_prompt and request.params.pooling is None
        row = Scheduled(request, tokens, samples, request.num_computed_tokens)
        draft.out.scheduled.append(row)
        draft.chosen.add(request.seq_id)
        draft.budget -= tokens
        if request.remaining == 1:
            draft.out.decode_seqs += 1
        else:
            draft.out.prefill_tokens += tokens
        if request.remaining > 1 or not request.num_generated:
            draft.out.chunks.append(row)  # a one-token prompt's row is a chunk too

    # ---- drafts (speculative decoding: service.engine.speculation) --------------------

    def _add_drafts(self, out: ScheduleOutput, token_budget: int | None) -> None:
        """Drafted tokens for the step's decodes, within the engine's and the policy's
        token budget."""
        if self.speculator is None:
            return
        cap = self.max_batched_tokens
        if isinstance(token_budget, int):  # a policy's, however wrong
            cap = min(cap, token_budget)
        self.speculator.draft_step(
            out.scheduled, self.blocks, self.step_cost, cap, self.plans.draft_synced
        )
        drafting = [item for item in out.scheduled if item.drafts]
        out.drafting_seqs = len(drafting)
        out.draft_tokens = sum(len(item.drafts) for item in drafting)

    def _observe_payoff(self, out: ScheduleOutput, step_ms: float) -> None:
        """A step ran: what its drafts paid, where a draft model measures it."""
        if self.speculator is not None:
            self.speculator.observe_step(out.scheduled, out.accepted_tokens, step_ms)

    # ---- tenants' slots (service.engine.tenants) ----------------------------------------

    def _admit_wanted(self, out: ScheduleOutput) -> None:
        """Admit the sequences tenants below their share want that the policy left waiting."""
        schedule = self.tenants.wanted_schedule(self.running)
        if not schedule:
            return
        before = len(out.scheduled)
        self._apply(Decision(schedule=schedule), out)
        self.corrections["tenant_slots_given"] += len(out.scheduled) - before

    def _fallback_decision(self) -> Decision:
        """Running sequences first, then waiting ones, as much of each as fits."""
        schedule = [(r.seq_id, r.remaining) for r in self.running]
        schedule += [(r.seq_id, r.remaining) for r in self.waiting]
        return Decision(schedule=schedule)


def _row(logprobs: TokenLogprobs, i: int) -> TokenLogprobs:
    return TokenLogprobs(
        logprobs.logprobs[i : i + 1], logprobs.top_ids[i : i + 1], logprobs.top_logprobs[i : i + 1]
    )
