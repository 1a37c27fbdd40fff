"""Speculative decoding in the worker: a step verifies a sequence's drafted tokens
(Row.drafts; gpu_worker.speculation).

Greedy: whatever the drafts, right, wrong or some of each, a sequence takes the tokens it
takes decoding one per step, beside prefilling and decoding sequences, and the cache after
a partial acceptance serves the steps that follow. Sampled: the first and the second token
a step returns follow the model's distribution for likely and unlikely drafts, and a seeded
sequence takes the same tokens as without drafts. Logprobs come a row per returned token;
drafts the worker cannot verify fail the step.
"""

from __future__ import annotations

import base64
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from gpu_worker import runtime
from gpu_worker.protocol import SamplingSpec, StepPlan, TokenLogprobs, WorkerConfig
from gpu_worker.runner import ModelRunner
from gpu_worker.sampler import apply_top_k
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model
from tests.worker_fixtures import (
    GREEDY,
    VOCAB,
    Chunk,
    blocks_for,
    make_runner,
    plan_for,
    random_prompt,
    sampled,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Drafter = Callable[[int], list[int]]  # tokens generated so far -> the drafts for the next step


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    return make_runner(tiny_llama_dir)


@dataclass(slots=True)
class Lane:
    """One sequence through a run of steps: its prompt in chunks, then decode steps, each
    with the drafts `drafter` proposes (none without one)."""

    seq_id: int
    prompt: list[int]
    table: list[int]
    drafter: Drafter | None = None
    spec: SamplingSpec = field(default_factory=SamplingSpec)
    chunk: int = 64  # prompt tokens per prefill step
    tokens: list[int] = field(default_factory=list)
    computed: int = 0  # positions with valid K/V
    returned: list[int] = field(default_factory=list)  # tokens each decode step returned
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)

    def step(self) -> tuple[Chunk, list[int]]:
        """This lane's chunk of the next step, and its drafts."""
        if self.computed < len(self.prompt):
            part = self.prompt[self.computed : self.computed + self.chunk]
            last = self.computed + len(part) == len(self.prompt)
            chunk = Chunk(
                self.seq_id,
                part,
                self.computed,
                self.table,
                last,
                self.spec,
                prompt_len=len(self.prompt),
            )
            return chunk, []
        drafts = self.drafter(len(self.tokens)) if self.drafter else []
        tokens = [self.tokens[-1], *drafts]
        chunk = Chunk(
            self.seq_id,
            tokens,
            self.computed,
            self.table,
            True,
            self.spec,
            prompt_len=len(self.prompt),
            drafts=drafts,
        )
        return chunk, drafts

    def take(self, chunk: Chunk, drafts: list[int], tokens: list[int] | None) -> None:
        """The step's result: the cache holds the chunk's positions up to the last kept."""
        self.computed = chunk.start + len(chunk.tokens)
        if tokens is None:
            return
        self.computed -= len(drafts) - (len(tokens) - 1)
        if chunk.start >= len(self.prompt):
            self.returned.append(len(tokens))
        self.tokens += tokens


def run_lanes(runner: ModelRunner, lanes: list[Lane], wanted: int) -> None:
    """Steps every lane together until each has `wanted` tokens (drafts may overshoot)."""
    step_id = 0
    while active := [lane for lane in lanes if len(lane.tokens) < wanted]:
        parts = [lane.step() for lane in active]
        plan = plan_for(runner, [chunk for chunk, _ in parts], step_id)
        result = runner.execute(plan)
        assert result.error is None, result.error
        got = dict(zip(result.seq_ids, result.tokens, strict=True))
        logprobs = split_logprobs(result.logprobs, result.tokens)
        for lane, (chunk, drafts) in zip(active, parts, strict=True):
            lane.take(chunk, drafts, got.get(lane.seq_id))
            if lane.seq_id in got and logprobs:
                lane.logprobs.extend(logprobs[result.seq_ids.index(lane.seq_id)])
        step_id += 1


def split_logprobs(found: TokenLogprobs | None, tokens: list[list[int]]) -> list[TokenLogprobs]:
    """A result's logprobs rows, cut by sequence as its tokens are."""
    if found is None:
        return []
    assert len(found) == sum(len(row) for row in tokens)
    parts, start = [], 0
    for row in tokens:
        end = start + len(row)
        parts.append(
            TokenLogprobs(
                found.logprobs[start:end], found.top_ids[start:end], found.top_logprobs[start:end]
            )
        )
        start = end
    return parts


def decoded(
    runner: ModelRunner,
    prompt: list[int],
    wanted: int,
    drafter: Drafter | None = None,
    spec: SamplingSpec = GREEDY,
) -> Lane:
    lane = Lane(0, prompt, blocks_for(0, len(prompt) + wanted + 16), drafter, spec)
    run_lanes(runner, [lane], wanted)
    return lane


def right(reference: list[int], k: int) -> Drafter:
    return lambda n: reference[n : n + k]


def wrong(reference: list[int], k: int) -> Drafter:
    return lambda n: [(token + 1) % VOCAB for token in reference[n : n + k]]


def mixed(reference: list[int], k: int) -> Drafter:
    """n % (k + 1) right drafts, then wrong ones: each step keeps a different number."""
    return lambda n: [
        token if i < n % (k + 1) else (token + 1) % VOCAB
        for i, token in enumerate(reference[n : n + k])
    ]


PROMPT = random_prompt(11, seed=3)
WANTED = 24


@pytest.fixture(scope="module")
def reference(runner) -> list[int]:
    """The prompt's greedy tokens, decoded one per step (and more, for the drafters)."""
    return decoded(runner, PROMPT, WANTED + 8).tokens


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("drafts", [right, wrong, mixed])
def test_greedy_drafts_keep_the_tokens_of_decoding_one_per_step(runner, reference, drafts, k):
    lane = decoded(runner, PROMPT, WANTED, drafts(reference, k))
    assert lane.tokens[:WANTED] == reference[:WANTED]
    # Each step keeps the drafts that were right, and only those.
    expected = {
        right: lambda n: k + 1,
        wrong: lambda n: 1,
        mixed: lambda n: min(n % (k + 1), k) + 1,
    }[drafts]
    counts, n = [], 1  # the prefill took the first token
    for returned in lane.returned:
        counts.append(expected(n))
        n += returned
    assert lane.returned == counts


def test_drafts_beside_prefilling_and_decoding_sequences(runner, reference):
    other_prompt, long_prompt = random_prompt(7, seed=4), random_prompt(30, seed=5)
    others = {
        seq_id: decoded(runner, prompt, WANTED + 8).tokens
        for seq_id, prompt in ((2, other_prompt), (3, long_prompt))
    }
    lanes = [
        Lane(0, PROMPT, blocks_for(0, 64), mixed(reference, 3)),
        Lane(1, PROMPT, blocks_for(16, 64), right(reference, 2)),
        Lane(2, other_prompt, blocks_for(32, 64), mixed(others[2], 2)),
        Lane(3, long_prompt, blocks_for(48, 64), chunk=5),  # prefills while the others decode
    ]
    run_lanes(runner, lanes, WANTED)
    assert [lane.tokens[:WANTED] for lane in lanes] == [
        reference[:WANTED],
        reference[:WANTED],
        others[2][:WANTED],
        others[3][:WANTED],
    ]
    assert max(lanes[1].returned) == 3


def test_drafts_on_a_model_with_sliding_windows(tiny_models):
    """Gemma 3's layers in KV groups of their own, with an 11-token window the drafts cross."""
    hybrid = make_runner(tiny_models("gemma3"))
    assert hybrid.limits.num_groups > 1
    expected = decoded(hybrid, PROMPT, WANTED + 8).tokens
    lane = decoded(hybrid, PROMPT, WANTED, mixed(expected, 3))
    assert lane.tokens[:WANTED] == expected[:WANTED]


def test_logprobs_come_a_row_per_returned_token(runner, reference):
    spec = SamplingSpec(logprobs=True, top_logprobs=3)
    plain = decoded(runner, PROMPT, WANTED, spec=spec)
    drafted = decoded(runner, PROMPT, WANTED, mixed(reference, 3), spec)
    assert drafted.tokens[:WANTED] == plain.tokens[:WANTED]
    assert len(drafted.logprobs) == len(drafted.tokens)
    assert drafted.logprobs.top_ids[:WANTED] == plain.logprobs.top_ids[:WANTED]
    assert drafted.logprobs.logprobs[:WANTED] == pytest.approx(
        plain.logprobs.logprobs[:WANTED], abs=1e-4
    )
    assert drafted.logprobs.top_logprobs[5] == pytest.approx(
        plain.logprobs.top_logprobs[5], abs=1e-4
    )


def test_logprobs_rows_follow_the_tokens_of_a_batch(runner, reference):
    """Rows in the order of the result's tokens flattened, whichever sequences ask."""
    asking = [SamplingSpec(logprobs=True, top_logprobs=2), SamplingSpec(logprobs=True), GREEDY]
    other = random_prompt(9, seed=7)
    solo = [
        decoded(runner, PROMPT, WANTED, spec=asking[0]),
        decoded(runner, other, WANTED, spec=asking[1]),
    ]
    lanes = [
        Lane(0, PROMPT, blocks_for(0, 64), mixed(reference, 3), asking[0]),
        Lane(1, other, blocks_for(16, 64), None, asking[1]),
        Lane(2, PROMPT, blocks_for(32, 64), right(reference, 2), asking[2]),
    ]
    run_lanes(runner, lanes, WANTED)
    assert [len(lane.logprobs) for lane in lanes] == [len(lane.tokens) for lane in lanes]
    assert lanes[2].tokens[:WANTED] == reference[:WANTED]
    assert not any(lanes[2].logprobs.top_ids)  # rows of chosen tokens only: it asked for none
    for lane, alone in zip(lanes[:2], solo, strict=True):
        assert lane.tokens[:WANTED] == alone.tokens[:WANTED]
        assert lane.logprobs.top_ids[:WANTED] == alone.logprobs.top_ids[:WANTED]
        assert lane.logprobs.logprobs[:WANTED] == pytest.approx(
            alone.logprobs.logprobs[:WANTED], abs=1e-4
        )


@pytest.mark.parametrize("drafts", [right, wrong, mixed])
def test_a_seeded_sequence_takes_its_tokens_without_drafts(runner, drafts):
    spec = SamplingSpec(temperature=1.0, top_k=20, seed=7)
    plain = decoded(runner, PROMPT, WANTED + 8, spec=spec).tokens
    assert (
        plain
        != decoded(
            runner, PROMPT, WANTED + 8, spec=SamplingSpec(temperature=1.0, top_k=20, seed=8)
        ).tokens
    )
    lane = decoded(runner, PROMPT, WANTED, drafts(plain, 3), spec)
    assert lane.tokens[:WANTED] == plain[:WANTED]
    if drafts is not wrong:
        assert max(lane.returned) > 1


@pytest.mark.parametrize("drafts", [right, wrong, mixed])
@pytest.mark.parametrize(
    "settings",
    [
        dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
        dict(temperature=1.0, seed=7, repetition_penalty=1.3, min_tokens=20),
    ],
)
def test_samplings_that_read_the_history_see_the_drafts_before_them(
    runner, reference, drafts, settings
):
    """The row after draft t sees the drafts up to t; the history keeps only the kept."""
    stops = sorted(set(reference[:4]))
    spec = SamplingSpec(**settings, bad_words=[reference[2:4]], min_tokens_stop_ids=stops)
    plain = decoded(runner, PROMPT, WANTED + 8, spec=spec).tokens
    assert plain[:WANTED] != reference[:WANTED]  # the processors change the tokens
    lane = decoded(runner, PROMPT, WANTED, drafts(plain, 3), spec)
    assert lane.tokens[:WANTED] == plain[:WANTED]
    if drafts is right:
        assert min(lane.returned) == 4


TRIALS = 6000
TRIALS_PER_STEP = 400
TOP_K = 6
PREFIX = random_prompt(8, seed=6)  # two whole blocks, shared by every trial


def distribution(logits: torch.Tensor) -> torch.Tensor:
    """What the trials draw from: temperature 1, the TOP_K most likely tokens."""
    return torch.softmax(apply_top_k(logits[None], [TOP_K])[0], dim=-1).double()


def chi_square_ok(counts: Counter[int], probs: torch.Tensor) -> bool:
    """Whether the counts fit `probs` at significance 1e-4 (bins expecting < 5 merged; the
    quantile by Wilson and Hilferty's approximation)."""
    total = sum(counts.values())
    expected = (probs * total).tolist()
    big = [t for t in range(len(expected)) if expected[t] >= 5]
    bins = [(counts[t], expected[t]) for t in big]
    small = set(range(len(expected))) - set(big)
    rest = (sum(counts[t] for t in small), sum(expected[t] for t in small))
    if rest[1] >= 1e-9 or rest[0]:
        bins.append(rest)
    if any(e == 0 and c for c, e in bins):
        return False  # drawn where the distribution has no mass
    statistic = sum((c - e) ** 2 / e for c, e in bins if e > 0)
    df = len(bins) - 1
    z = 3.719  # the standard normal's 1 - 1e-4 quantile
    quantile = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic < quantile


def trials(runner: ModelRunner, last: int, drafts: list[int]) -> list[list[int]]:
    """TRIALS sequences after PREFIX + [last], each seeded by its index, with `drafts`."""
    spec = SamplingSpec(temperature=1.0, top_k=TOP_K)
    found = []
    for first in range(0, TRIALS, TRIALS_PER_STEP):
        chunks = [
            Chunk(
                1 + i,
                [last, *drafts],
                len(PREFIX),
                [0, 1, 2 + i],
                True,
                _seeded(spec, first + i),
                drafts=drafts,
            )
            for i in range(TRIALS_PER_STEP)
        ]
        plan = plan_for(runner, chunks, first)
        result = runner.execute(plan)
        assert result.error is None, result.error
        found += result.tokens
    return found


def _seeded(spec: SamplingSpec, seed: int) -> SamplingSpec:
    return SamplingSpec(temperature=spec.temperature, top_k=spec.top_k, seed=1000 + seed)


def next_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """float32 logits after PREFIX + tokens."""
    chunk = Chunk(0, tokens, len(PREFIX), [0, 1, 2 + TRIALS_PER_STEP])
    return runner.step_logits(plan_for(runner, [chunk]))[0]


@pytest.mark.parametrize("likely", [True, False])
def test_sampled_tokens_follow_the_models_distribution(runner, likely):
    runner.execute(plan_for(runner, [Chunk(0, PREFIX, 0, [0, 1], sample=False)]))
    last = PREFIX[-1]
    first = distribution(next_logits(runner, [last]))
    ranked = first.argsort(descending=True).tolist()
    # a likely draft, or the least likely token the top-k leaves
    d1 = ranked[0] if likely else ranked[TOP_K - 1]
    second = distribution(next_logits(runner, [last, d1]))
    d2 = int(second.argmax()) if likely else int(second.argsort()[-TOP_K])
    found = trials(runner, last, [d1, d2])
    assert chi_square_ok(Counter(tokens[0] for tokens in found), first)
    after_d1 = Counter(tokens[1] for tokens in found if len(tokens) > 1)
    assert sum(after_d1.values()) == sum(1 for tokens in found if tokens[0] == d1)
    assert sum(after_d1.values()) > 500
    assert chi_square_ok(after_d1, second)


def test_the_chi_square_check_rejects_a_wrong_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert chi_square_ok(Counter({0: 500, 1: 300, 2: 200}), probs)
    assert not chi_square_ok(Counter({0: 580, 1: 260, 2: 160}), probs)
    assert not chi_square_ok(
        Counter({0: 500, 1: 300, 2: 199, 3: 1}), torch.tensor([0.5, 0.3, 0.2, 0.0])
    )


def drafted_plan(runner: ModelRunner, spec: SamplingSpec = GREEDY) -> StepPlan:
    tokens = PROMPT[:4]
    drafting = Chunk(0, tokens, 0, [0, 1], True, spec, drafts=tokens[1:])
    return plan_for(runner, [drafting, Chunk(1, [5], 0, [2])])


def refused(plan: StepPlan, runner: ModelRunner) -> str:
    result = runner.execute(plan)
    assert result.error is not None and not result.tokens
    return result.error


def test_drafts_the_worker_cannot_verify_fail_the_step(runner):
    with_grammar = drafted_plan(runner)
    with_grammar.rows[0].bitmask = base64.b64encode(bytes(VOCAB // 8)).decode()
    assert "grammar" in refused(with_grammar, runner)
    not_the_inputs = drafted_plan(runner)
    not_the_inputs.rows[0].drafts = [7, 7, 7]
    assert "last tokens" in refused(not_the_inputs, runner)
    too_many = drafted_plan(runner)
    too_many.rows[0].drafts = PROMPT[:4]
    assert "4 drafts in a chunk of 4" in refused(too_many, runner)
    unsampled = drafted_plan(runner)
    unsampled.rows[0].sample = False
    assert "does not sample" in refused(unsampled, runner)
    result = runner.execute(drafted_plan(runner))  # the same plan, as it came
    assert result.error is None and 1 <= len(result.tokens[0]) <= 4 and len(result.tokens[1]) == 1


def test_a_grammar_beside_drafts_holds(runner):
    assert runner.execute(drafted_plan(runner)).tokens[1] != [5]  # what the mask rules out
    plan = drafted_plan(runner)
    only_5 = torch.zeros(VOCAB // 32, dtype=torch.int32)
    only_5[0] = 1 << 5
    plan.rows[1].bitmask = base64.b64encode(only_5.numpy().tobytes()).decode()
    result = runner.execute(plan)
    assert result.error is None and result.tokens[1] == [5]


def test_empty_drafts_are_a_plain_step(runner, reference):
    """A decode-only plan whose draft lists are all empty takes the decode path."""
    table = blocks_for(0, 16)
    assert sampled(runner.execute(plan_for(runner, [Chunk(0, PROMPT, 0, table)]))) == reference[:1]
    plan = plan_for(runner, [Chunk(0, reference[:1], len(PROMPT), table)])
    assert not plan.rows[0].drafts
    assert sampled(runner.execute(plan)) == reference[1:2]


@pytest.mark.real_model
def test_the_default_model_in_bfloat16_keeps_its_greedy_tokens():
    """A near-tie of bfloat16 logits flips with any difference in a row's arithmetic: the
    drafted steps' rows must be computed as the decode steps' are (and sampled with the
    same refinement, gpu_worker.model.Model.logits)."""
    config = WorkerConfig(
        model_dir=str(resolve_model(None, default_cache_dir())),
        dtype="bfloat16",
        device="cpu",
        kv_memory=float(1 << 26),
        kernel_cache=str(default_cache_dir() / "kernels.json"),
    )
    real = runtime.start(config)
    prompt = random_prompt(16, seed=9)
    for spec in (GREEDY, SamplingSpec(temperature=0.8, top_p=0.9, seed=3)):
        reference = decoded(real, prompt, WANTED + 8, spec=spec).tokens
        for drafter, most in ((mixed(reference, 3), 4), (right(reference, 4), 5)):
            lane = decoded(real, prompt, WANTED, drafter, spec)
            assert lane.tokens[:WANTED] == reference[:WANTED]
            assert max(lane.returned) == most
