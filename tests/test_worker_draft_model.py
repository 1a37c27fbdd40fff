"""Speculative decoding with a draft model, in the worker (gpu_worker.draft_model): the
worker chooses a plan's DRAFT_MODEL_TOKEN drafts with its draft model and verifies them.

Whatever the draft model (the model itself: every draft right; another: nearly every one
wrong), a greedy sequence takes the tokens of decoding one per step and a seeded one those
it takes without drafts, beside a sequence that prefills, with the draft model's context
sent in pieces. A draft model of another vocabulary is refused at start, and a plan the
worker cannot serve fails its step, saying why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpu_worker.protocol import DRAFT_MODEL_TOKEN, SamplingSpec, StepPlan
from gpu_worker.runner import ModelRunner
from tests.worker_fixtures import (
    Chunk,
    blocks_for,
    generate_greedy,
    make_runner,
    plan_for,
    random_prompt,
    save_tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = random_prompt(13, seed=7)
WANTED = 20
K = 3


@pytest.fixture(scope="module")
def draft_dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The model itself, and another of its vocabulary (one layer: other weights)."""
    other = save_tiny_model(tmp_path_factory.mktemp("tiny_draft"), num_hidden_layers=1)
    return {"itself": tiny_llama_dir, "another": other}


@pytest.fixture(scope="module")
def runners(tiny_llama_dir: Path, draft_dirs: dict[str, Path]) -> dict[str, ModelRunner]:
    return {
        name: make_runner(tiny_llama_dir, draft_model_dir=str(path))
        for name, path in draft_dirs.items()
    }


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> ModelRunner:
    return make_runner(tiny_llama_dir)


@dataclass(slots=True)
class Lane:
    """One sequence, and what the service tracks for it: the positions with K/V in each
    model's cache (`computed`, `synced`)."""

    seq_id: int
    prompt: list[int]
    table: list[int]
    spec: SamplingSpec = field(default_factory=SamplingSpec)
    drafts: int = K  # drafts asked for at each decode step
    context_piece: int = 1000  # the most context tokens sent in one step
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    synced: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.tokens

    def step(self) -> tuple[Chunk, list[int], list[int]]:
        """Its chunk, its drafts and the draft model's context."""
        if self.computed < len(self.prompt):
            return Chunk(self.seq_id, self.prompt, 0, self.table, True, self.spec), [], []
        missing = self.all_tokens[self.synced : self.computed] if self.drafts else []
        if len(missing) > self.context_piece:
            return self._decode([]), [], missing[: self.context_piece]
        drafts = [DRAFT_MODEL_TOKEN] * self.drafts
        return self._decode(drafts), drafts, missing

    def _decode(self, drafts: list[int]) -> Chunk:
        tokens = [self.tokens[-1], *drafts]
        return Chunk(self.seq_id, tokens, self.computed, self.table, True, self.spec)

    def take(self, chunk: Chunk, drafts: list[int], context: list[int], got: list[int]) -> None:
        if chunk.start == 0:
            self.computed = len(self.prompt)
        elif drafts:
            accepted = len(got) - 1
            self.synced = self.computed + 1 + min(accepted, len(drafts) - 1)
            self.computed += 1 + accepted
            self.drafted += len(drafts)
            self.accepted += accepted
        else:
            self.synced += len(context)
            self.computed += 1
        self.tokens += got


def run_lanes(runner: ModelRunner, lanes: list[Lane], wanted: int) -> None:
    step_id = 0
    while active := [lane for lane in lanes if len(lane.tokens) < wanted]:
        parts = [lane.step() for lane in active]
        plan = plan_for(runner, [chunk for chunk, _, _ in parts], step_id)
        plan = with_draft_fields(plan, parts, [lane.synced for lane in active])
        result = runner.execute(plan)
        assert result.error is None, result.error
        got = dict(zip(result.seq_ids, result.tokens, strict=True))
        for lane, (chunk, drafts, context) in zip(active, parts, strict=True):
            lane.take(chunk, drafts, context, got[lane.seq_id])
        step_id += 1


def with_draft_fields(plan: StepPlan, parts: list, synced: list[int]) -> StepPlan:
    for row, (_, drafts, context), start in zip(plan.rows, parts, synced, strict=True):
        row.drafts, row.draft_context = drafts, context
        row.draft_start = start if context else 0
    return plan


def decoded(runner: ModelRunner, prompt: list[int], wanted: int, **lane) -> Lane:
    one = Lane(0, prompt, blocks_for(0, len(prompt) + wanted + 16), **lane)
    run_lanes(runner, [one], wanted)
    return one


@pytest.fixture(scope="module")
def reference(plain: ModelRunner) -> list[int]:
    return generate_greedy(plain, PROMPT, WANTED + K + 1)


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_greedy_takes_the_tokens_of_decoding_one_per_step(runners, reference, draft):
    lane = decoded(runners[draft], PROMPT, WANTED)
    assert lane.tokens[:WANTED] == reference[:WANTED]
    if draft == "itself":  # the model's own argmax: every draft is right
        assert lane.accepted == lane.drafted > 0
    else:
        assert lane.accepted < lane.drafted / 2


def test_the_context_can_come_in_pieces(runners, reference):
    # the prompt's context goes in 4 steps of 4 tokens before the first drafts
    lane = decoded(runners["itself"], PROMPT, WANTED, context_piece=4)
    assert lane.tokens[:WANTED] == reference[:WANTED]
    assert lane.accepted == lane.drafted > 0


def test_drafting_beside_a_prefill_and_a_plain_decode(runners, plain):
    other = random_prompt(9, seed=8)
    expected = [generate_greedy(plain, p, WANTED + K + 1, seq_id=9) for p in (PROMPT, other)]
    lanes = [
        Lane(0, PROMPT, blocks_for(0, 64)),
        Lane(1, other, blocks_for(16, 64), drafts=0),  # decodes without drafts
        Lane(2, other, blocks_for(32, 64), drafts=2),
    ]
    run_lanes(runners["itself"], lanes[:2], 3)  # lane 2 prefills while 0 and 1 decode
    run_lanes(runners["itself"], lanes, WANTED)
    assert [lane.tokens[:WANTED] for lane in lanes] == [
        expected[0][:WANTED],
        expected[1][:WANTED],
        expected[1][:WANTED],
    ]


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_a_seeded_sequence_takes_its_tokens_without_drafts(runners, plain, draft):
    spec = SamplingSpec(temperature=0.9, seed=11)
    without = decoded(plain, PROMPT, WANTED, spec=spec, drafts=0)
    drafted = decoded(runners[draft], PROMPT, WANTED, spec=spec)
    assert drafted.tokens[:WANTED] == without.tokens[:WANTED]
    assert drafted.drafted > 0


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    other = save_tiny_model(tmp_path / "wide", vocab_size=320)
    with pytest.raises(ValueError, match="share the model's tokenizer"):
        make_runner(tiny_llama_dir, draft_model_dir=str(other))


def step_error(runner: ModelRunner, plan: StepPlan) -> str:
    result = runner.execute(plan)
    assert result.error is not None and not result.tokens
    return result.error


def test_a_worker_without_a_draft_model_says_so(plain):
    chunk = Chunk(0, [5, DRAFT_MODEL_TOKEN], 4, blocks_for(0, 8))
    plan = plan_for(plain, [chunk])
    plan.rows[0].drafts = [DRAFT_MODEL_TOKEN]
    assert "has none" in step_error(plain, plan)


def test_context_that_does_not_reach_the_chunk_fails_the_step(runners):
    chunk = Chunk(0, [5, DRAFT_MODEL_TOKEN], 4, blocks_for(0, 8))
    plan = plan_for(runners["itself"], [chunk])
    plan.rows[0].drafts, plan.rows[0].draft_context = [DRAFT_MODEL_TOKEN], [1, 2]
    assert "does not reach its chunk" in step_error(runners["itself"], plan)
