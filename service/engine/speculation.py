"""Speculative decoding, the service's part: which tokens a decoding sequence drafts, and
how many drafted tokens a step may carry (the worker verifies them: Row.drafts).

Drafting is n-gram prompt lookup, as vLLM's NgramProposer: the sequence's last n tokens (n
from prompt_lookup_max down to prompt_lookup_min) are looked up in its prompt and output,
and the tokens that followed their most recent earlier occurrence are proposed. Code,
quotes, lists and edited documents repeat themselves; where the text does not, nothing is
found and nothing is drafted. The lookup reads the last `_WINDOW` tokens only, so its cost
per decoding sequence and step is bounded whatever the sequence's length.

No stream's ITL gets worse. Drafts are what a step adds last: the scheduler first places
every decoding sequence's own token and the policy's prefill chunks, and drafts take only
the token budget left after them (the engine's cap and the policy's own, Decision's
token_budget) and blocks that are free, neither promised nor in the watermark, so drafts
never preempt nor delay an admission. They also take only time the step-cost model says is
nearly free: the step with its drafts may be predicted to cost at most
(1 + step_cost_tolerance) x the step without them. On a CPU at low batch a step reads the
weights once whatever its rows, so a few rows more cost little and sequences draft their
full k; at batch 64 each row is paid for, the allowance is a handful of tokens, and drafting
stops. The engine's model (service.engine.step_cost) is linear in tokens: fitted to prefill
chunks, which are compute-bound, it would price a decode's extra rows at a chunk's rate and
forbid the drafts that are nearly free. So a decode-only step is priced by a model of the
same form fitted to decode-only steps alone (drafts included: their rows teach it what rows
cost there), and a step with prefill chunks by the engine's. Past the most tokens a
decode-only step has been measured with, the decode model extrapolates (with every step of
one batch size alike, it cannot tell a row's cost from the base's): there a draft is priced
at the dearer of the two models, the engine's being the compute-bound price no row exceeds,
so that a step that tries more rows than ever stays within the tolerance too. Before the
model in use has measured enough steps, only a decode-only step of at most
`_UNFITTED_STEP_TOKENS` tokens (drafts included) whose every row drafts (below) drafts. A
step with drafts costs up to the tolerance more, and in exchange a sequence whose drafts are
accepted advances several tokens in it.

That bound is what others pay for a sequence's drafts. Where nobody else pays, because
every row of a small decode-only step (at most `_SELF_PAID_SEQS` sequences: the machine is
near idle) drafts, each sequence's own tokens are what a longer step buys: the step may
then grow by up to half the tokens its drafts are expected to add (Acceptance.expected,
Leviathan's 1 + a + ... + a^k for an acceptance a per token) times the step without them,
so that each of its streams still gets its tokens sooner than without drafts. On this CPU
a lone stream's step of 1 + 4 rows costs about 25% more than one row in bfloat16, which the
strict bound would never allow.

A request drafts fewer tokens when its drafts are rejected: each keeps an exponential
average of accepted / drafted (acceptance.Acceptance), and drafts round(num_speculative_tokens x
that average); at 0 it probes with one token every `PROBE_EVERY` decode steps, so a text
that starts repeating itself is found again. Requests whose next token's distribution
reads their history (penalties, bad words, min_tokens), structured output (a plan carries
a grammar's mask for one position) and prompt log-probabilities still in flight never
draft. Sampled requests do: the worker keeps a draft with the probability the token has
there, so the tokens' distribution is that of decoding without drafts (and a seeded
request's tokens are the same, whatever the load let it draft).

A draft model (method draft_model) drafts in the worker: a sequence asks for k drafts as
DRAFT_MODEL_TOKEN placeholders (gpu_worker.draft_model), priced and budgeted as any k
drafts. The draft model has its own cache over the sequence's blocks and runs only where
asked, so the service tracks what it holds (PlanBuilder.draft_synced: the positions before it
have K/V there) and sends what it lacks first (`missing_context`): the prompt, on a first
draft, or the tokens of the steps a sequence decoded without drafting. Those are a
prefill for the draft model, priced at the engine's per-token cost of a prefill chunk
within the same allowance; where the allowance cannot take them all, the step sends what
fits and drafts nothing, and the sequence drafts once the rest has gone. A draft model
drafts only in steps whose drafts pay for themselves (every row of a step of at most
`_SELF_PAID_SEQS` decodes drafts): each of its passes costs the same whether one row drafts
or all do, a fixed cost that the per-token price of the tolerance bound cannot bound. So
beside a prefill or in a larger batch nothing drafts, nothing is sent, and the draft model
does not run. Nor is the allowance, whose prices are fitted to steps, trusted to say that
a draft model's drafts pay: Payoff measures what each stream's tokens cost with drafts
and without, and a step drafts while drafts measure cheaper (a draft model nearly as
costly as the model, or rejected, stops drafting but for a probe now and then). A probe
that drafts again is bounded by the step's token budget alone: the allowance, fitted to
the steps that made drafting stop, would give it no drafts, and a text that starts to
pay (or a machine that frees up) would never be measured again.

Overlap (Config.overlap) does not stop drafting: the overlapped loop schedules step k+1
only after update() has committed step k's tokens (only their text goes out later), so the
drafts of k+1 are drawn from every accepted token.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from gpu_worker.protocol import DRAFT_MODEL_TOKEN, QUANTIZATIONS
from policies.base import StepCost
from service.engine.acceptance import PROBE_EVERY, RATE_WEIGHT
from service.engine.block_manager import BlockManager
from service.engine.request import Request
from service.engine.step_cost import StepCostModel, plan_terms

# The lookup reads this many of a sequence's last tokens: its cost per step stays bounded.
_WINDOW = 1024
# Before the step-cost model is fitted: the largest decode-only step that drafts.
_UNFITTED_STEP_TOKENS = 16
# The most sequences of a decode-only step whose drafts pay for themselves (module docstring)
_SELF_PAID_SEQS = 4
# Of the tokens a step's drafts are expected to add, the share of a step's time they may
# cost where they pay for themselves: below 1, each stream still gains.
_SELF_PAID_SHARE = 0.5
_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "step_cost_tolerance",
    "model",
    "quantization",
)
NGRAM, DRAFT_MODEL = "ngram", "draft_model"
_MODEL_FIELDS = ("model", "quantization")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """--speculative-config, vLLM's field names (and cadence's step_cost_tolerance)."""

    method: str = NGRAM  # or DRAFT_MODEL: a second model drafts (gpu_worker.draft_model)
    num_speculative_tokens: int = 4  # the most tokens a sequence drafts in one step
    prompt_lookup_max: int = 4  # the longest suffix looked up
    prompt_lookup_min: int = 2  # the shortest
    # a step with drafts may be predicted to cost at most this fraction more than without
    step_cost_tolerance: float = 0.05
    # the draft model, as --model names one (a directory, a GGUF file, a packaged model)
    model: str | None = None
    quantization: str = "none"  # the draft model's weights, as --quantization

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's JSON; ValueError saying what is wrong. As vLLM, a missing
    prompt_lookup_min or _max takes the other's value (both missing: 2 and 4), and a
    config that names a model and no method is the draft model's."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative config must be a JSON object: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"speculative config must be a JSON object, got {text!r}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown speculative config field(s) {unknown}; expected {list(_FIELDS)}")
    method = raw.get("method", DRAFT_MODEL if "model" in raw else None)
    if method == DRAFT_MODEL:
        return _draft_model_config(raw)
    if method != NGRAM:
        raise ValueError(
            f"speculative config method must be 'ngram' or 'draft_model', got {method!r}"
        )
    if set(raw) & set(_MODEL_FIELDS):
        raise ValueError("speculative config: method 'ngram' takes no model nor quantization")
    if "num_speculative_tokens" not in raw:
        raise ValueError("speculative config needs num_speculative_tokens")
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if low is None and high is None:
        default = SpeculativeConfig()
        low, high = default.prompt_lookup_min, default.prompt_lookup_max
    lookup = {
        "prompt_lookup_min": high if low is None else low,
        "prompt_lookup_max": low if high is None else high,
    }
    config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=_int(raw, "num_speculative_tokens", 1, 64),
        prompt_lookup_max=_int(lookup, "prompt_lookup_max", 1, 64),
        prompt_lookup_min=_int(lookup, "prompt_lookup_min", 1, 64),
        step_cost_tolerance=_tolerance(raw.get("step_cost_tolerance", 0.05)),
    )
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError("speculative config: prompt_lookup_min must be <= prompt_lookup_max")
    return config


def _draft_model_config(raw: dict[str, Any]) -> SpeculativeConfig:
    lookups = sorted(set(raw) & {"prompt_lookup_min", "prompt_lookup_max"})
    if lookups:
        raise ValueError(f"speculative config: method 'draft_model' takes no {lookups}")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("speculative config: method 'draft_model' needs a model (a path)")
    quantization = raw.get("quantization", "none")
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"speculative config: quantization must be one of {', '.join(QUANTIZATIONS)}, "
            f"got {quantization!r}"
        )
    if "num_speculative_tokens" not in raw:
        raise ValueError("speculative config needs num_speculative_tokens")
    return SpeculativeConfig(
        method=DRAFT_MODEL,
        num_speculative_tokens=_int(raw, "num_speculative_tokens", 1, 64),
        model=model,
        quantization=quantization,
        step_cost_tolerance=_tolerance(raw.get("step_cost_tolerance", 0.05)),
    )


def _int(raw: dict[str, Any], name: str, low: int, high: int) -> int:
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(
            f"speculative config: {name} must be an integer {low}..{high}, got {value!r}"
        )
    return value


def _tolerance(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"speculative config: step_cost_tolerance must be 0..1, got {value!r}")
    return float(value)


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n
    tokens of `tokens` (the longest n from n_max down to n_min that occurs; [] if none).
    Where the copy reaches the end it goes on through the tokens it proposed, so a
    pattern shorter than k repeats."""
    window = tokens[-_WINDOW:]
    if k < 1 or len(window) <= n_min or window[-1] not in window[:-1]:
        return []  # the common case in text that does not repeat, without numpy's cost
    ctx = np.asarray(window, dtype=np.int64)
    # an occurrence's last token equals the sequence's last one, and is followed by a token
    ends = np.flatnonzero(ctx[:-1] == ctx[-1])
    for n in range(min(n_max, len(ctx) - 1), n_min - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):
            found = found[ctx[found - back] == ctx[-1 - back]]
        if found.size:
            start = int(found[-1]) + 1
            return _repeat(ctx[start : start + k].tolist(), len(ctx) - start, k)
    return []


def _repeat(copied: list[int], period: int, k: int) -> list[int]:
    """`copied` (the tokens up to the sequence's end) continued through itself to k."""
    for i in range(len(copied), k):
        copied.append(copied[i - period])
    return copied


def may_draft(request: Request) -> bool:
    """Whether drafting can change neither the request's tokens nor their distribution
    (module docstring)."""
    params = request.params
    return not (
        request.grammar is not None
        or params.sampling.reads_history
        or params.pooling is not None
        or request.needs_prompt_logprobs
    )


class DraftRow(Protocol):
    """A row of a step, as the speculator reads it and gives it drafts (step.Scheduled)."""

    request: Request
    num_tokens: int  # of its own tokens (a decode's: 1)
    samples: bool
    drafts: list[int]
    draft_context: list[int]
    draft_start: int


def decodes(row: DraftRow) -> bool:
    """A step's row computes one token and samples after it: it may draft."""
    return row.samples and row.num_tokens == 1


def _dearer(cost: StepCost, other: StepCost | None) -> StepCost:
    """`cost` with the dearer of the two prices of a row and of a key read."""
    if other is None:
        return cost
    return StepCost(
        base_ms=cost.base_ms,
        ms_per_token=max(cost.ms_per_token, other.ms_per_token),
        ms_per_pair=cost.ms_per_pair,
        ms_per_context=max(cost.ms_per_context, other.ms_per_context),
    )


def draft_ms(cost: StepCost, context: int, k: int) -> float:
    """What `k` drafts add to a step for a sequence with `context` cached tokens: their
    tokens, and their attention priced as k more decodes (step_cost.plan_terms)."""
    return cost.ms_per_token * k + cost.ms_per_context * (k * context + k * (k + 1) // 2)


@dataclass(slots=True)
class DraftAllowance:
    """What the drafts of one step may still take: tokens of the budget, and time."""

    tokens: int
    extra_ms: float  # math.inf before the cost model is fitted (tokens bound it then)
    cost: StepCost | None  # the price of a draft within the measured steps' tokens
    beyond: StepCost | None = None  # past them (module docstring); None: `cost` throughout
    measured: int = 0  # drafts the step may take before it passes the measured tokens
    # the price of a token of a draft model's context: a prefill chunk's (module docstring)
    context_cost: StepCost | None = None

    def take_context(self, n: int) -> int:
        """How many of `n` context tokens of a draft model fit; takes them."""
        n = max(0, min(n, self.tokens))
        cost = self.context_cost or self.cost
        price = 0.0 if cost is None else cost.ms_per_token
        if n and price > 0 and math.isfinite(self.extra_ms):
            n = min(n, max(0, math.floor(self.extra_ms / price)))
            self.extra_ms -= n * price
        self.tokens -= n
        return n

    def room(self, context: int, k: int) -> int:
        """How many of `k` drafts of a sequence at `context` would fit."""
        k = max(0, min(k, self.tokens))
        while k and self.cost is not None and self._ms(context, k) > self.extra_ms:
            k -= 1
        return k

    def take(self, context: int, k: int) -> int:
        """How many of `k` drafts of a sequence at `context` fit; takes them."""
        k = self.room(context, k)
        if self.cost is not None:
            self.extra_ms -= self._ms(context, k)
        self.measured -= min(k, self.measured)
        self.tokens -= k
        return k

    def _ms(self, context: int, k: int) -> float:
        assert self.cost is not None
        inside = min(k, self.measured)
        beyond = self.beyond or self.cost
        return draft_ms(self.cost, context, inside) + draft_ms(beyond, context + inside, k - inside)


@dataclass(slots=True)
class Drafted:
    """What one decoding sequence drafts in a step."""

    tokens: list[int] = field(default_factory=list)  # its drafts (DRAFT_MODEL_TOKEN: unchosen)
    # the draft model's: the tokens it computes first, from position context_start
    context: list[int] = field(default_factory=list)
    context_start: int = 0


@dataclass(slots=True)
class Payoff:
    """What a draft model's drafts buy, measured: for decode steps of one number of rows,
    the milliseconds per token each stream takes with drafts and without (exponential
    averages). A step drafts while that is less than without, and every `PROBE_EVERY`
    steps the other way is measured again, since both change with the text and the load."""

    drafting_ms: float | None = None
    plain_ms: float | None = None
    since_other: int = 0  # steps since the way that is not chosen was measured

    def drafts(self) -> bool:
        """Whether the next such step drafts: at first it does, until the first probe."""
        return self._drafting_is_better() != (self.since_other >= PROBE_EVERY)

    def probing(self) -> bool:
        """Whether the next such step drafts to measure drafts again, drafting being the
        dearer way so far."""
        return self.since_other >= PROBE_EVERY and not self._drafting_is_better()

    def record(self, rows: int, drafted: bool, accepted: int, step_ms: float) -> None:
        """A decode step of `rows` streams: with drafts (or the draft model's context) or
        without, `accepted` drafts kept over all its rows."""
        per_token = step_ms * rows / (rows + accepted)
        probed = drafted != self._drafting_is_better()
        if drafted:
            self.drafting_ms = _averaged(self.drafting_ms, per_token)
        else:
            self.plain_ms = _averaged(self.plain_ms, per_token)
        self.since_other = 0 if probed else self.since_other + 1

    def _drafting_is_better(self) -> bool:
        if self.drafting_ms is None or self.plain_ms is None:
            return True  # unmeasured: drafting, until the first probe
        return self.drafting_ms < self.plain_ms


def _averaged(average: float | None, value: float) -> float:
    return value if average is None else (1 - RATE_WEIGHT) * average + RATE_WEIGHT * value


class Speculator:
    """Drafts for the decoding sequences of one step, within its allowance."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.decode_cost = StepCostModel()  # fitted to decode-only steps (module docstring)
        self.widest = 0  # the most tokens of a decode-only step measured
        # a draft model's, per number of rows of a step whose drafts pay for themselves
        self.payoffs = {rows: Payoff() for rows in range(1, _SELF_PAID_SEQS + 1)}

    def observe(
        self, num_tokens: list[int], start_pos: list[int], drafted: list[int], step_ms: float
    ) -> None:
        """A measured step (a plan's rows, each one's drafts): the decode model learns
        from those without prefill chunks."""
        if all(n == 1 or k for n, k in zip(num_tokens, drafted, strict=True)):
            self.decode_cost.observe_plan(num_tokens, start_pos, step_ms, drafted)
            self.widest = max(self.widest, sum(num_tokens))

    def allowance(
        self,
        step_cost: StepCostModel,
        num_tokens: list[int],
        start_pos: list[int],
        tokens_left: int,
        self_paid: float = 0.0,
    ) -> DraftAllowance:
        """What drafts may add to a step of these rows (none drafted yet), `tokens_left` of
        its budget unused; `step_cost` prices a step with prefill chunks. `self_paid`: the
        fewest tokens any row's drafts are expected to add, where every row drafts (module
        docstring); 0 where others would pay."""
        decode_only = all(n == 1 for n in num_tokens)
        if self_paid and self._probes_drafts(len(num_tokens)):
            return DraftAllowance(max(0, tokens_left), math.inf, None)  # module docstring
        # the engine's model prices a decode-only step's drafts only past what was measured
        engines = step_cost.recent() if decode_only else step_cost.estimate()
        cost = self.decode_cost.estimate() if decode_only else engines
        if cost is None:  # unknown costs: only drafts that pay for themselves, a few
            small = _UNFITTED_STEP_TOKENS - sum(num_tokens) if decode_only and self_paid else 0
            return DraftAllowance(max(0, min(tokens_left, small)), math.inf, None)
        step_ms = cost.step_ms(*plan_terms(num_tokens, start_pos))
        share = max(self.config.step_cost_tolerance, _SELF_PAID_SHARE * self_paid)
        extra_ms = share * step_ms
        allowance = DraftAllowance(max(0, tokens_left), extra_ms, cost, context_cost=engines)
        if decode_only:
            allowance.beyond = _dearer(cost, engines)
            allowance.measured = max(0, self.widest - sum(num_tokens))
        return allowance

    def draft_step(
        self,
        rows: Sequence[DraftRow],
        blocks: BlockManager,
        step_cost: StepCostModel,
        cap: int,
        synced: Callable[[int], int],
    ) -> None:
        """Drafted tokens for the decodes of a step of `rows`, within what the rows leave of
        `cap` tokens and of the time the cost model allows, the sequences whose drafts were
        accepted most first; their blocks allocated (`_draft_room`). `synced(seq_id)`: the
        positions the worker's draft model holds K/V for (PlanBuilder.draft_synced)."""
        decoding = [row for row in rows if decodes(row) and may_draft(row.request)]
        if not decoding:
            return
        num_tokens = [row.num_tokens for row in rows]
        starts = [row.request.num_computed_tokens for row in rows]
        left = cap - sum(num_tokens)
        decoding.sort(key=lambda row: (-row.request.acceptance.rate, row.request.seq_id))
        proposals = self._self_paid_proposals(len(rows), decoding, blocks)
        requests = [row.request for row in decoding]
        self_paid = self.self_paid(requests, proposals) if proposals else 0.0
        if not self.others_may_pay and not (self_paid and self.draft_model_pays(len(decoding))):
            return
        allowance = self.allowance(step_cost, num_tokens, starts, left, self_paid)
        for index, row in enumerate(decoding):
            request = row.request
            held = synced(request.seq_id)
            if self_paid:  # the blocks earlier rows' drafts took are no longer free
                proposal = proposals[index][: self._draft_room(request, blocks)]
                drafted = self.take(request, allowance, proposal, held)
            else:
                room = self._draft_room(request, blocks)
                drafted = self.draft(request, allowance, room, held)
            row.draft_context, row.draft_start = drafted.context, drafted.context_start
            drafts = drafted.tokens
            if drafts:
                blocks.allocate(request.seq_id, request.num_computed_tokens + 1 + len(drafts))
                row.drafts = drafts

    def _self_paid_proposals(
        self, num_rows: int, decoding: list[DraftRow], blocks: BlockManager
    ) -> list[list[int]]:
        """Where the step of `num_rows` rows is a few decodes that may all draft, each one's
        proposal (the lookups cost little there); [] otherwise."""
        if len(decoding) != num_rows or not self.self_paid_size(len(decoding)):
            return []
        proposals = []
        for row in decoding:
            k = self.wanted(row.request, self._draft_room(row.request, blocks))
            proposals.append(self.propose(row.request, k) if k else [])
        return proposals

    def _draft_room(self, request: Request, blocks: BlockManager) -> int:
        """The most drafts `request` may append whose blocks are free, unpromised and
        above the watermark: drafts never preempt, nor take what admission counts on."""
        start = request.num_computed_tokens + 1
        spare = max(0, blocks.num_admittable)
        room = self.config.num_speculative_tokens
        while room and blocks.extra_blocks(request.seq_id, start + room) > spare:
            room -= 1
        return room

    def draft(
        self, request: Request, allowance: DraftAllowance, room: int, synced: int = 0
    ) -> Drafted:
        """What `request` (decoding, may_draft) drafts this step: at most `room` tokens
        (its blocks' and its max_tokens' bound), as many as its acceptance wants and the
        allowance takes; `synced`: the positions its draft model holds K/V for."""
        k = allowance.room(request.num_computed_tokens, self.wanted(request, room))
        if k < 1:  # before the lookup: a full step costs no lookups
            return Drafted()
        return self.take(request, allowance, self.propose(request, k), synced)

    def wanted(self, request: Request, room: int) -> int:
        """How many tokens `request` would draft, its allowance aside."""
        assert request.params.max_tokens is not None  # validation fills it
        k = request.acceptance.wanted(self.config.num_speculative_tokens)
        # one token is sampled after the drafts: never past max_tokens
        return max(0, min(k, room, request.params.max_tokens - request.num_generated - 1))

    def propose(self, request: Request, k: int) -> list[int]:
        """k tokens or fewer; the draft model's k are its to choose (DRAFT_MODEL_TOKEN)."""
        config = self.config
        if config.method == DRAFT_MODEL:
            return [DRAFT_MODEL_TOKEN] * k
        return propose_ngram(
            request.token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def take(
        self, request: Request, allowance: DraftAllowance, proposal: list[int], synced: int = 0
    ) -> Drafted:
        """Of a proposal, the drafts the allowance takes. A draft model first computes the
        context it lacks (module docstring): until all of it fits in a step, the step
        sends it what fits, and no drafts."""
        context = self.missing_context(request, synced)
        if context:
            sent = allowance.take_context(len(context))
            if sent < len(context):
                return Drafted([], context[:sent], synced)
            return Drafted(self._taken(request, allowance, proposal), context, synced)
        return Drafted(self._taken(request, allowance, proposal))

    def _taken(self, request: Request, allowance: DraftAllowance, proposal: list[int]) -> list[int]:
        return proposal[: allowance.take(request.num_computed_tokens, len(proposal))]

    def missing_context(self, request: Request, synced: int) -> list[int]:
        """The tokens before `request`'s next position that its draft model has no K/V
        for, those from `synced` on ([] without a draft model)."""
        if self.config.method != DRAFT_MODEL:
            return []
        return request.token_ids[synced : request.num_computed_tokens]

    @property
    def others_may_pay(self) -> bool:
        """Whether a step's drafts may cost its other rows (up to the tolerance): n-gram
        drafts, whose cost is their rows'. A draft model's passes cost the same however
        few rows draft, which a price per token cannot bound: it drafts only where every
        row does (module docstring)."""
        return self.config.method == NGRAM

    def draft_model_pays(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows, all drafting, drafts: always for n-gram
        drafts, for a draft model's while they measure to pay (Payoff)."""
        return self.others_may_pay or self.payoffs[rows].drafts()

    def _probes_drafts(self, rows: int) -> bool:
        return not self.others_may_pay and self.payoffs[rows].probing()  # rows: self-paid

    def observe_step(self, rows: Sequence[DraftRow], accepted: int, step_ms: float) -> None:
        """A step of `rows` ran, `accepted` drafts kept: if its rows are decodes alone, each
        sampling, what its tokens cost (a draft model's Payoff)."""
        if self.others_may_pay or not all(decodes(row) for row in rows):
            return
        drafted = any(row.drafts or row.draft_context for row in rows)
        if len(rows) in self.payoffs:
            self.payoffs[len(rows)].record(len(rows), drafted, accepted, step_ms)

    def self_paid_size(self, rows: int) -> bool:
        """Whether a decode-only step of `rows` rows may have drafts that pay for themselves."""
        return 0 < rows <= _SELF_PAID_SEQS

    def self_paid(self, requests: list[Request], proposals: list[list[int]]) -> float:
        """The fewest tokens any of a step's rows expects its drafts to add, when every row
        has some (module docstring); 0 otherwise."""
        if not self.self_paid_size(len(requests)) or not all(proposals):
            return 0.0
        return min(r.acceptance.expected(len(p)) for r, p in zip(requests, proposals, strict=True))
