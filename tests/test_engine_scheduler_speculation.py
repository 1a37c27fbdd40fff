"""The scheduler with drafted tokens (speculative decoding): what a plan carries, what a
result of 1 + j tokens commits, where a run of tokens stops, and the property that drafts
never break the core's promises (budget, blocks, prefix cache) whatever the policy and
the worker's verdicts."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_worker.protocol import DRAFT_MODEL_TOKEN, StepResult
from policies.base import Decision
from service.engine.block_manager import BlockManager, chain_hashes
from service.engine.invariants import check_invariants
from service.engine.request import Request, SamplingParams, SamplingSpec, Status
from service.engine.scheduler import Scheduler
from service.engine.speculation import DRAFT_MODEL, SpeculativeConfig
from service.engine.step import ScheduleOutput
from tests.plan_columns import column
from tests.scheduler_helpers import make_request, make_scheduler
from tests.sim_worker import EOS
from tests.test_engine_scheduler_properties import decisions

PATTERN = [1, 2, 3]
SPEC = SpeculativeConfig(num_speculative_tokens=4)
DRAFT_SPEC = SpeculativeConfig(method=DRAFT_MODEL, num_speculative_tokens=4, model="draft")


def scheduler(**kw) -> Scheduler:
    kw = {"num_blocks": 32, "block_size": 4, "max_tokens": 64, "max_seqs": 8, **kw}
    sched, _ = make_scheduler(speculative=SPEC, **kw)
    return sched


def plan(sched: Scheduler, schedule: list[tuple[int, int]], **kw) -> ScheduleOutput:
    sched.policy.next = Decision(schedule=schedule, **kw)  # type: ignore[attr-defined]
    return sched.schedule(now=0.0)


def answer(out: ScheduleOutput, tokens: dict[int, list[int]]):
    """The worker's result: the tokens each sampling sequence takes (by seq_id)."""
    ids = [item.request.seq_id for item in out.scheduled if item.samples]
    return StepResult(out.iteration, ids, [tokens[i] for i in ids])


def decoding(sched: Scheduler, seq_id: int = 0, *, max_tokens: int = 16, **params) -> Request:
    """A request whose 9-token prompt repeats PATTERN, prefilled, its first token sampled
    (the pattern's next): it decodes next, and its last tokens occurred before."""
    request = make_request(seq_id, 9, max_tokens=max_tokens, pattern=PATTERN)
    request.params = SamplingParams(max_tokens=max_tokens, **params)
    sched.add(request)
    out = plan(sched, [(seq_id, 9)])
    assert out.plan is not None and not column(out.plan, "drafts")  # a prefill chunk drafts not
    sched.update(out, answer(out, {seq_id: [1]}))
    return request


def test_a_decode_carries_its_drafts_at_the_positions_after_its_token():
    sched = scheduler()
    request = decoding(sched)
    out = plan(sched, [(0, 1)])
    assert out.plan is not None
    assert column(out.plan, "drafts") == [[2, 3, 1, 2]]
    assert out.plan.num_tokens == [5] and out.plan.start_pos == [9]
    assert out.plan.input_ids == [1, 2, 3, 1, 2]  # its last token, then the drafts
    assert len(sched.blocks.table(0)) == 4  # positions 9..13
    assert (out.drafting_seqs, out.draft_tokens) == (1, 4)
    assert request.num_computed_tokens == 9  # nothing committed before the result


def test_a_result_commits_its_token_and_the_accepted_drafts_only():
    sched = scheduler()
    request = decoding(sched)
    out = plan(sched, [(0, 1)])
    outcomes = sched.update(out, answer(out, {0: [2, 3, 7]}))  # 2 drafts kept, then 7
    assert [o.token for o in outcomes] == [2, 3, 7]
    assert request.token_ids[9:] == [1, 2, 3, 7]
    assert request.num_computed_tokens == 12  # 9 + its token + 2 drafts
    assert sched.blocks.num_held(0) == 3  # the 4th block held only rejected drafts
    assert (request.acceptance.drafted, request.acceptance.accepted) == (4, 2)
    assert (out.accepted_tokens, sched.draft_tokens, sched.accepted_tokens) == (2, 4, 2)
    check_invariants(sched)


def test_eos_among_the_accepted_drafts_ends_the_sequence_there():
    sched = scheduler()
    eos_pattern = [1, 2, EOS]
    request = make_request(0, 9, max_tokens=16, pattern=eos_pattern)
    request.params = SamplingParams(max_tokens=16, ignore_eos=False)
    sched.add(request)
    out = plan(sched, [(0, 9)])
    sched.update(out, answer(out, {0: [1]}))
    out = plan(sched, [(0, 1)])
    assert out.plan is not None and column(out.plan, "drafts") == [[2, EOS, 1, 2]]
    outcomes = sched.update(out, answer(out, {0: [2, EOS, 1, 2, 9]}))
    assert [(o.token, o.finish) for o in outcomes] == [(2, None), (EOS, ("stop", "eos"))]
    assert request.token_ids[-3:] == [1, 2, EOS]  # what followed EOS is dropped
    assert sched.blocks.num_free == 32 and not sched.running


def test_a_stop_token_among_the_drafts_ends_it_too():
    sched = scheduler()
    request = decoding(sched, stop_token_ids=[3])
    out = plan(sched, [(0, 1)])
    outcomes = sched.update(out, answer(out, {0: [2, 3, 1, 2, 3]}))
    assert [o.finish for o in outcomes] == [None, ("stop", "stop_token")]
    assert request.num_generated == 3 and sched.blocks.num_free == 32


def test_drafts_never_run_past_max_tokens():
    sched = scheduler()
    request = decoding(sched, max_tokens=3)  # one generated: two to go
    out = plan(sched, [(0, 1)])
    assert out.plan is not None and column(out.plan, "drafts") == [[2]]  # and the one after it
    outcomes = sched.update(out, answer(out, {0: [2, 3]}))
    assert [o.finish for o in outcomes] == [None, ("length", "max_tokens")]
    assert request.num_generated == 3


def test_a_request_at_its_last_token_drafts_nothing():
    sched = scheduler()
    decoding(sched, max_tokens=2)
    out = plan(sched, [(0, 1)])
    assert out.plan is not None and column(out.plan, "drafts") == [] and out.plan.num_tokens == [1]


def test_drafts_take_only_the_budget_the_engine_and_the_policy_leave():
    sched = scheduler(max_tokens=9)
    for seq_id in range(3):
        decoding(sched, seq_id)
    out = plan(sched, [(0, 1), (1, 1), (2, 1)])
    assert out.plan is not None and out.plan.total_tokens == 9
    assert column(out.plan, "drafts") == [[2, 3, 1, 2], [2, 3], []]  # the most accepted first
    sched.update(out, answer(out, {0: [5], 1: [5], 2: [5]}))
    sched = scheduler()
    for seq_id in range(3):
        decoding(sched, seq_id)
    out = plan(sched, [(0, 1), (1, 1), (2, 1)], token_budget=5)
    assert out.plan is not None and out.plan.total_tokens == 5
    assert column(out.plan, "drafts") == [[2, 3], [], []]
    sched.update(out, answer(out, {0: [2, 3, 1], 1: [2], 2: [2]}))
    out = plan(sched, [(0, 1), (1, 1), (2, 1)], token_budget="wrong")
    assert out.plan is not None  # a policy's bad budget: the engine's cap alone
    assert out.plan.total_tokens == 3 + 12


def test_drafts_take_no_block_promised_to_a_prefill_or_kept_by_the_watermark():
    # 3 blocks of 4: the decode holds 3 (positions 0..9 and its token's), none is free
    sched = scheduler(num_blocks=3)
    decoding(sched)
    out = plan(sched, [(0, 1)])
    assert out.plan is not None and column(out.plan, "drafts") == [[2, 3]]  # its block's room
    sched.update(out, answer(out, {0: [2, 3, 1]}))
    sched = scheduler(num_blocks=8)
    for tokens in range(1, 11):  # steps whose rows cost nearly nothing: drafts fit anywhere
        sched.step_cost.observe(tokens, 0, 0, 10.0 + 0.001 * tokens)
    decoding(sched)  # 3 blocks
    waiting = make_request(1, 20, max_tokens=2)
    sched.add(waiting)
    out = plan(sched, [(0, 1), (1, 4)])  # admitted: 5 blocks promised, 1 allocated
    assert out.plan is not None and sched.blocks.num_available == 0
    assert column(out.plan, "drafts") == [[2, 3], []]


def test_a_request_whose_sampling_reads_its_history_never_drafts():
    sched = scheduler()
    decoding(sched, sampling=SamplingSpec(repetition_penalty=1.2))
    out = plan(sched, [(0, 1)])
    assert out.plan is not None and column(out.plan, "drafts") == [] and out.draft_tokens == 0


def test_rejections_make_a_request_draft_less():
    sched = scheduler()
    request = decoding(sched, max_tokens=60)
    drafted = []
    for step in range(6):
        out = plan(sched, [(0, 1)])
        drafted.append(out.draft_tokens)
        # every draft rejected; the token continues the pattern, so the lookup finds more
        sched.update(out, answer(out, {0: [PATTERN[(step + 1) % 3]]}))
    assert drafted[0] == 4 and drafted == sorted(drafted, reverse=True) and drafted[-1] < 4
    assert request.acceptance.accepted == 0


# ---- the property -------------------------------------------------------------------------


def check_drafts(sched: Scheduler, out: ScheduleOutput, budget: object, before: dict) -> None:
    plan = out.plan
    if plan is None:
        return
    cap = sched.max_batched_tokens
    if isinstance(budget, int):
        cap = min(cap, budget)
    own = sum(item.num_tokens for item in out.scheduled)
    assert plan.total_tokens <= sched.max_batched_tokens
    context = sum(map(len, column(plan, "draft_context")))  # a draft model's: budgeted as drafts
    assert out.draft_tokens + context <= max(0, cap - own), "drafts past the budget"
    assert out.draft_tokens == sum(map(len, column(plan, "drafts")))
    if out.draft_tokens or context:  # the cost model is never fitted here (no step times)
        assert own == len(plan.seq_ids) and plan.total_tokens + context <= 16  # a small step
    offset = 0
    for i, item in enumerate(out.scheduled):
        request, drafts = item.request, item.drafts
        n, start = plan.num_tokens[i], plan.start_pos[i]
        if item.draft_context:  # what the draft model lacks, from where it stopped
            assert column(plan, "draft_context")[i] == item.draft_context
            assert (
                item.draft_context
                == request.token_ids[item.draft_start : start][: len(item.draft_context)]
            )
            assert not drafts or item.draft_start + len(item.draft_context) == start
        if drafts:
            assert item.samples and item.num_tokens == 1 and n == 1 + len(drafts)
            assert (
                column(plan, "drafts")[i] == drafts and len(drafts) <= SPEC.num_speculative_tokens
            )
            if DRAFT_MODEL_TOKEN in drafts:
                assert set(drafts) == {DRAFT_MODEL_TOKEN}
                assert sched.plans.draft_synced(request.seq_id) + len(item.draft_context) == start
            generated = before[request.seq_id][1] - request.prompt_len
            assert generated + len(drafts) + 1 <= request.params.max_tokens  # type: ignore[operator]
            assert plan.input_ids[offset : offset + n] == [request.token_ids[start], *drafts]
        table = sched.blocks.table(request.seq_id)
        assert len(table) == -(-(start + n) // sched.blocks.block_size)
        offset += n


def verdicts(draw: st.DrawFn, out: ScheduleOutput) -> StepResult:
    """The worker's: each row keeps some of its drafts, then samples a token (EOS now and then)."""
    tokens = {}
    for item in out.scheduled:
        if item.samples:
            kept = draw(st.integers(0, len(item.drafts)), label="accepted")
            last = draw(st.sampled_from([1, 2, 3, 3, 9, EOS]), label="sampled")
            drafts = item.drafts
            if DRAFT_MODEL_TOKEN in drafts:  # the draft model's choice
                drafts = [draw(st.sampled_from([1, 2, 3]), label="drafted") for _ in drafts]
            tokens[item.request.seq_id] = [*drafts[:kept], last]
    return answer(out, tokens)


def check_cache(sched: Scheduler, live: dict[int, Request]) -> None:
    """A block registered in the prefix cache holds the committed tokens its hash names
    (in a full group: a windowed one's table keeps the ids of blocks it gave back)."""
    blocks = sched.blocks
    if blocks.windows[0] is not None:
        return
    for request in live.values():
        if request.status is not Status.RUNNING:
            continue
        hashes = chain_hashes(request.token_ids, blocks.block_size, [], None)
        table = blocks.table(request.seq_id)
        computed = request.num_computed_tokens // blocks.block_size
        for index, block in enumerate(table):
            if blocks.is_cached(block):
                assert index < computed, "a block past the computed tokens is cached"
                assert blocks._hash_of[block][1] == hashes[index], "a block's hash lies"


# Long on purpose (PLR0915): one trace, every promise after every step
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(4, 24),
    block_size=st.integers(1, 6),
    max_tokens=st.integers(1, 40),
    max_seqs=st.integers(1, 5),
    watermark=st.sampled_from([0.0, 0.1]),
    prefix_caching=st.booleans(),
    steps=st.integers(1, 25),
    groups=st.sampled_from([("full",), ("full",), ("full", "w"), ("w",)]),
    window=st.integers(1, 12),
    spec=st.sampled_from([SPEC, DRAFT_SPEC]),
)
def test_drafts_keep_every_promise_whatever_the_policy_and_the_verdicts(  # noqa: PLR0915
    data: st.DataObject,
    num_blocks: int,
    block_size: int,
    max_tokens: int,
    max_seqs: int,
    watermark: float,
    prefix_caching: bool,
    steps: int,
    groups: tuple[str, ...],
    window: int,
    spec: SpeculativeConfig,
):
    """On one table per sequence, and on a hybrid model's KV groups; with n-gram drafts
    and with a draft model's."""
    sched, policy = make_scheduler(
        num_blocks,
        block_size,
        max_tokens,
        max_seqs,
        watermark,
        prefix_caching=prefix_caching,
        speculative=spec,
    )
    if groups != ("full",):
        windows = [None if kind == "full" else window for kind in groups]
        blocks = BlockManager(
            num_blocks,
            block_size,
            watermark,
            enable_caching=prefix_caching,
            windows=windows,
            max_chunk_tokens=max_tokens,
        )
        sched.replace_blocks(blocks)
    capacity = min(sched.capacity_tokens, 200)
    live: dict[int, Request] = {}
    arrived = 0
    for iteration in range(steps):
        for _ in range(data.draw(st.integers(0, 2), label="arrivals")):
            max_new = data.draw(st.integers(1, 12), label="max_tokens")
            if capacity - max_new < 1:
                continue
            prompt = data.draw(st.integers(1, min(capacity - max_new, 30)), label="prompt")
            pattern = data.draw(st.sampled_from([[1, 2, 3], [3], [1, 2, 3, 9]]), label="text")
            request = make_request(arrived, prompt, pattern=pattern)
            request.params = SamplingParams(max_tokens=max_new)
            arrived += 1
            sched.add(request)
            live[request.seq_id] = request
        decision = Decision()
        if data.draw(st.booleans(), label="script a decision"):
            decision = data.draw(decisions(sorted(live)), label="decision")
        decision.token_budget = data.draw(
            st.one_of(st.none(), st.integers(0, 40), st.just("x")), label="policy budget"
        )
        policy.next = decision
        before = {s: (r.num_computed_tokens, r.num_tokens) for s, r in live.items()}
        out = sched.schedule(now=float(iteration))
        check_drafts(sched, out, decision.token_budget, before)
        check_invariants(sched)
        if out.plan is None:
            continue
        outcomes = sched.update(out, verdicts(data.draw, out))
        for outcome in outcomes:
            if outcome.finish is not None:
                outcome.request.status = Status.FINISHED
                del live[outcome.request.seq_id]
        for item, start in zip(out.scheduled, out.plan.start_pos, strict=True):
            request = item.request
            if request.is_finished:
                continue
            taken = request.num_tokens - before[request.seq_id][1]
            assert request.num_computed_tokens == start + item.num_tokens + max(0, taken - 1)
            assert request.num_generated <= request.params.max_tokens  # type: ignore[operator]
        for request in sched.running:
            entries = -(-request.num_computed_tokens // block_size)
            assert len(sched.blocks.table(request.seq_id)) == entries, "draft blocks kept"
        check_cache(sched, live)
        check_invariants(sched)
    for request in list(live.values()):
        sched.remove(request)
    assert sched.blocks.num_free == num_blocks and not sched.has_work()
