"""A token's logits are the same bits however the worker computes its row.

A decode step puts a sequence beside whatever else is running, and recompute after a
preemption prefills, in chunks under the token budget, tokens that were decoded one per
step. Greedy output stays the solo run's only if a row's arithmetic depends neither on its
company nor on which kernel (decode or prefill) runs it. In bfloat16, the default, any
difference is enough to flip a near-tie, so equality here is bitwise. On the default model,
in bfloat16 and in float32.

The sampler's part: a row that asks for no logit processor (penalties, logit_bias, ...)
draws the same tokens whether or not the rows beside it ask for them.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker import runtime
from gpu_worker.protocol import SamplingSpec, StepPlan, WorkerConfig
from gpu_worker.runner import ModelRunner
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model
from tests.worker_fixtures import Chunk, make_plan, plan_for, sampled

pytestmark = pytest.mark.real_model

PROMPT = 21  # tokens prefilled before decoding starts
LENGTH = 45  # prompt and decoded tokens
OTHERS = 15  # sequences that may share a decode step
SEQ = 0


def random_tokens(count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (count,), generator=generator).tolist()


TOKENS = random_tokens(LENGTH, seed=1)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def runner(request) -> ModelRunner:
    model_dir = resolve_model(None, default_cache_dir())
    # The kernels the chooser picks, as a server would (with the kernel cache, where this
    # machine's matmul call-size checks are recorded: a CPU without AVX512-BF16 takes a
    # minute to probe them): only row-invariant attention serves where one passes its
    # check, and every matmul runs in checked call sizes.
    config = WorkerConfig(
        model_dir=str(model_dir),
        dtype=request.param,
        device="cpu",
        kv_memory=float(1 << 28),
        kernel_cache=str(default_cache_dir() / "kernels.json"),
    )
    return runtime.start(config)


class Blocks:
    """Hands out fresh block tables, so that no two sequences (or runs) share a block."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next = 0

    def table(self, tokens: int) -> list[int]:
        count = -(-tokens // self.block_size)
        self.next += count
        return list(range(self.next - count, self.next))


def logits_by_position(runner: ModelRunner, steps: list[list[Chunk]]) -> dict[int, torch.Tensor]:
    """Runs the steps; the logits of SEQ's last row in each, by that row's position."""
    found = {}
    for chunks in steps:
        logits = runner.step_logits(make_plan(chunks))
        mine = next(i for i, c in enumerate(chunks) if c.seq_id == SEQ)
        found[chunks[mine].start + len(chunks[mine].tokens) - 1] = logits[mine]
    return found


def decoding_steps(table: list[int], company: list[list[Chunk]]) -> list[list[Chunk]]:
    """The prompt in one chunk, then one token per step, each beside company[i]."""
    steps = [[Chunk(SEQ, TOKENS[:PROMPT], 0, table)]]
    for i, position in enumerate(range(PROMPT, LENGTH)):
        steps.append([Chunk(SEQ, [TOKENS[position]], position, table), *company[i]])
    return steps


def decoding_company(runner: ModelRunner, blocks: Blocks) -> list[list[Chunk]]:
    """Other sequences, prefilled now, and for each decode step some of them (all OTHERS in
    the first) decoding one token each at their own positions: the batch size changes
    every step."""
    lengths = [5 + 7 * i % 30 for i in range(OTHERS)]
    tables = [blocks.table(n + LENGTH) for n in lengths]
    prompts = [random_tokens(n, seed=100 + i) for i, n in enumerate(lengths)]
    others = range(1, OTHERS + 1)
    runner.step_logits(make_plan([Chunk(s, prompts[s - 1], 0, tables[s - 1]) for s in others]))
    positions = list(lengths)
    company = []
    for step in range(LENGTH - PROMPT):
        beside = []
        for s in others[: OTHERS - (step * 4) % OTHERS]:
            beside.append(Chunk(s, [TOKENS[step]], positions[s - 1], tables[s - 1]))
            positions[s - 1] += 1
        company.append(beside)
    return company


def recompute_steps(table: list[int], chunk: int, beside: list[Chunk]) -> list[list[Chunk]]:
    """The whole sequence again, as after a preemption: prefill chunks of `chunk` tokens."""
    return [
        [Chunk(SEQ, TOKENS[start : start + chunk], start, table), *beside]
        for start in range(0, LENGTH, chunk)
    ]


def assert_same_bits(found: dict[int, torch.Tensor], reference: dict[int, torch.Tensor]) -> None:
    """Equal logits at every position both have (decoded positions: the prompt's last on)."""
    shared = sorted(found.keys() & reference.keys())
    assert shared
    differing = [p for p in shared if not torch.equal(found[p], reference[p])]
    assert not differing, f"logits differ at positions {differing} of {shared}"


@pytest.fixture(scope="module")
def decoded_alone(runner: ModelRunner) -> dict[int, torch.Tensor]:
    blocks = Blocks(runner.cache.block_size)
    no_company = [[] for _ in range(LENGTH - PROMPT)]
    return logits_by_position(runner, decoding_steps(blocks.table(LENGTH), no_company))


def test_a_decode_row_ignores_the_sequences_beside_it(runner, decoded_alone):
    blocks = Blocks(runner.cache.block_size)
    table = blocks.table(LENGTH)
    company = decoding_company(runner, blocks)
    assert_same_bits(logits_by_position(runner, decoding_steps(table, company)), decoded_alone)


@pytest.mark.parametrize("chunk", [2, 7, 16, LENGTH])
def test_recompute_in_chunks_gives_the_decoded_bits(runner, decoded_alone, chunk):
    blocks = Blocks(runner.cache.block_size)
    found = logits_by_position(runner, recompute_steps(blocks.table(LENGTH), chunk, []))
    assert_same_bits(found, decoded_alone)


def test_recompute_beside_decode_rows_gives_the_decoded_bits(runner, decoded_alone):
    blocks = Blocks(runner.cache.block_size)
    table = blocks.table(LENGTH)
    company = decoding_company(runner, blocks)
    found = logits_by_position(runner, recompute_steps(table, 6, company[0]))
    assert_same_bits(found, decoded_alone)


FREE = [SamplingSpec(), SamplingSpec(temperature=0.8, seed=5)]
PROCESSED = [
    SamplingSpec(
        temperature=0.9,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias=[(11, 5.0), (12, -3.0)],
        min_p=0.1,
    ),
    SamplingSpec(repetition_penalty=2.0, allowed_token_ids=[11, 12, 13]),
    SamplingSpec(temperature=0.7, bad_words=[[11], [12, 13]], min_tokens=4),
]
GENERATED = 6


def generate_beside(
    runner: ModelRunner, blocks: Blocks, company: list[SamplingSpec]
) -> list[list[int]]:
    """FREE's sequences and one per company spec, prefilled together, then decoding
    together: the tokens each sampled, in that order."""
    specs = FREE + company
    seq_ids = [SEQ, *range(100, 100 + len(specs) - 1)]
    # the company's prompts: 13, 17, 21, ... tokens (a seq id, 100 on, made them 400 long)
    prompts = [TOKENS[:PROMPT]] + [
        random_tokens(9 + 4 * i, seed=50 + i) for i in range(1, len(specs))
    ]
    tables = [blocks.table(len(p) + GENERATED) for p in prompts]
    chunks = [
        Chunk(s, p, 0, t, spec=spec)
        for s, p, t, spec in zip(seq_ids, prompts, tables, specs, strict=True)
    ]
    tokens: list[list[int]] = [[] for _ in specs]
    for _ in range(GENERATED):
        for row, token in enumerate(sampled(runner.execute(plan_for(runner, chunks)))):
            tokens[row].append(token)
        chunks = [
            Chunk(
                c.seq_id,
                [found[-1]],
                c.start + len(c.tokens),
                c.table,
                spec=c.spec,
                prompt_len=len(p),
            )
            for c, found, p in zip(chunks, tokens, prompts, strict=True)
        ]
    runner.execute(StepPlan(-1, [], [], finished=seq_ids))
    return tokens


def test_a_free_row_samples_the_same_tokens_beside_processed_rows(runner):
    blocks = Blocks(runner.cache.block_size)
    alone = generate_beside(runner, blocks, [])
    beside = generate_beside(runner, blocks, PROCESSED)
    assert beside[: len(FREE)] == alone
    assert set(beside[len(FREE) + 1]) <= {11, 12, 13}  # the processors did run in that batch
    assert len(runner.table.histories) == 0  # the finished sequences counted nothing more
