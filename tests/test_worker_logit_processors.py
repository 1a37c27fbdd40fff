"""vLLM's sampling parameters in the worker's sampler, against references computed here from
the raw logits: penalties, logit_bias, allowed_token_ids, min_p (each the distribution it
must sample from, and the draws following it), bad words and min_tokens; and the worker's
per-sequence histories that the penalties read."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.logit_processors import adjust_logits
from gpu_worker.protocol import (
    FrameDecoder,
    NewSeq,
    Row,
    SamplingSpec,
    StepPlan,
    encode_frame,
    step_plan_from_message,
    to_message,
)
from gpu_worker.sampler import Sampler
from gpu_worker.seq_table import Histories, PlanLimits, RowTokens, SeqTable

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 40
CPU = torch.device("cpu")
DRAWS = 4000


def raw_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def row_tokens(prompts: list[list[int]], outputs: list[list[int]]) -> RowTokens:
    counts = torch.zeros(len(outputs), VOCAB, dtype=torch.int32)
    seen = torch.zeros(len(prompts), VOCAB, dtype=torch.bool)
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for token in output:
            counts[i, token] += 1
        seen[i, prompt + output] = True
    rows = list(range(len(prompts)))
    return RowTokens(rows, torch.tensor(rows), counts, seen, [list(o) for o in outputs])


def vllm_penalties(
    logits: torch.Tensor, prompt: list[int], output: list[int], spec: SamplingSpec
) -> torch.Tensor:
    """vLLM's apply_penalties for one row, token by token."""
    out = logits.clone()
    for token in range(VOCAB):
        count = output.count(token)
        if token in prompt or count:
            value = out[token]
            rep = spec.repetition_penalty
            out[token] = value / rep if value > 0 else value * rep
        out[token] -= spec.frequency_penalty * count + spec.presence_penalty * (count > 0)
    return out


def empirical(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / len(tokens)


def draws(logits: torch.Tensor, spec: SamplingSpec, tokens: RowTokens | None = None) -> list[int]:
    """DRAWS tokens sampled from one row's logits (the row repeated, with its history)."""
    batch = logits.expand(DRAWS, -1).clone()
    if tokens is not None:  # every row reads the one history
        slots = tokens.slots.expand(DRAWS)
        tokens = RowTokens(
            list(range(DRAWS)), slots, tokens.output_counts, tokens.seen, tokens.generated * DRAWS
        )
    return Sampler(0, CPU).sample(batch, [spec] * DRAWS, [0] * DRAWS, None, tokens).tokens


def assert_follows(tokens: list[int], expected: torch.Tensor) -> None:
    """The draws' frequencies are the distribution's, with no token it rules out."""
    found = empirical(tokens)
    assert set(found.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert 0.5 * (found - expected).abs().sum() < 0.05


PROMPTS = [[1, 2, 3, 3], [5, 6], [7], [1, 9]]
OUTPUTS = [[2, 4, 4, 4, 8], [6, 6, 10], [], [11, 11, 1]]
PENALTIES = [
    SamplingSpec(repetition_penalty=1.3),
    SamplingSpec(frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingSpec(presence_penalty=2.0, repetition_penalty=0.8),
    SamplingSpec(frequency_penalty=-1.5, presence_penalty=1.0, repetition_penalty=1.9),
]


def test_penalties_are_vllms_on_each_row():
    logits = raw_logits(4)
    found = adjust_logits(logits.clone(), PENALTIES, row_tokens(PROMPTS, OUTPUTS))
    for i, spec in enumerate(PENALTIES):
        expected = vllm_penalties(logits[i], PROMPTS[i], OUTPUTS[i], spec)
        assert found[i].tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_rows_without_parameters_keep_their_exact_logits():
    logits = raw_logits(3)
    specs = [SamplingSpec(), PENALTIES[3], SamplingSpec(temperature=0.7)]
    history = row_tokens([PROMPTS[3]], [OUTPUTS[3]])
    history.rows = [1]  # its table's row 0
    found = adjust_logits(logits.clone(), specs, history)
    assert torch.equal(found[0], logits[0]) and torch.equal(found[2], logits[2])
    assert not torch.equal(found[1], logits[1])


def test_sampling_with_penalties_follows_the_penalised_distribution():
    logits = raw_logits(1, seed=3)[0]
    spec = SamplingSpec(temperature=0.9, frequency_penalty=0.8, repetition_penalty=1.4)
    prompt, output = [0, 1, 2], [int(logits.argmax())] * 3
    expected = torch.softmax(vllm_penalties(logits, prompt, output, spec) / 0.9, dim=-1)
    assert_follows(draws(logits, spec, row_tokens([prompt], [output])), expected)


def test_logit_bias_is_added_to_its_tokens():
    logits = raw_logits(1, seed=4)[0]
    bias = [(3, 2.5), (17, -100.0), (int(logits.argmin()), 12.0)]
    spec = SamplingSpec(temperature=1.0, logit_bias=bias)
    biased = logits.clone()
    for token, value in bias:
        biased[token] += value
    assert_follows(draws(logits, spec), torch.softmax(biased, dim=-1))
    greedy = Sampler(0, CPU).sample(logits[None], [SamplingSpec(logit_bias=bias)], [0]).tokens
    assert greedy == [int(biased.argmax())] != [int(logits.argmax())]


def test_allowed_token_ids_restrict_the_distribution_to_them():
    logits = raw_logits(1, seed=5)[0]
    allowed = [2, 8, 9, 30]
    spec = SamplingSpec(temperature=1.3, allowed_token_ids=allowed)
    expected = torch.zeros(VOCAB)
    expected[allowed] = torch.softmax(logits[allowed] / 1.3, dim=-1)
    assert_follows(draws(logits, spec), expected)


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_keeps_tokens_above_its_share_of_the_best_after_temperature(min_p):
    logits = raw_logits(1, seed=6)[0]
    probs = torch.softmax(logits / 0.7, dim=-1)
    kept = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    spec = SamplingSpec(temperature=0.7, min_p=min_p)
    assert_follows(draws(logits, spec), kept / kept.sum())


def test_logprobs_stay_those_of_the_raw_logits():
    logits = raw_logits(1, seed=7)
    spec = SamplingSpec(logprobs=True, logit_bias=[(5, 50.0)], allowed_token_ids=[5, 6])
    out = Sampler(0, CPU).sample(logits, [spec], [0])
    assert out.tokens == [5]
    raw = torch.log_softmax(logits[0], dim=-1)[5].item()
    assert out.logprobs is not None and out.logprobs.logprobs == pytest.approx([raw])


def test_a_bad_word_bans_its_last_token_after_the_rest_of_it():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8], logits[0, 9] = 3.0, 2.0, 1.0
    spec = SamplingSpec(bad_words=[[4, 5, 7], [8], [6, 9]])

    def greedy_after(generated: list[int]) -> int:
        history = row_tokens([[]], [generated])
        return Sampler(0, CPU).sample(logits, [spec], [0], None, history).tokens[0]

    assert greedy_after([1, 4, 5]) == 9  # 7 follows "4 5", 8 always banned
    assert greedy_after([4, 5, 1]) == 7
    assert greedy_after([5]) == 7


def test_min_tokens_masks_the_stop_tokens_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2], logits[0, 3], logits[0, 11] = 5.0, 4.0, 1.0
    spec = SamplingSpec(min_tokens=3, min_tokens_stop_ids=[2, 3])

    def greedy_after(generated: list[int]) -> int:
        history = row_tokens([[]], [generated])
        return Sampler(0, CPU).sample(logits, [spec], [0], None, history).tokens[0]

    assert [greedy_after([11] * n) for n in range(5)] == [11, 11, 11, 2, 2]


def test_bans_that_leave_no_token_yield_to_the_grammar():
    logits = raw_logits(2, seed=8)
    grammar = torch.zeros(2, -(-VOCAB // 32), dtype=torch.int32)  # bitmask words
    grammar[:, 0] = 0b1100  # tokens 2 and 3
    specs = [
        SamplingSpec(allowed_token_ids=[5, 6]),  # nothing the grammar allows
        SamplingSpec(temperature=1.0, allowed_token_ids=[3, 6]),
    ]
    out = Sampler(0, CPU).sample(logits, specs, [0, 0], [grammar[0], grammar[1]])
    assert out.tokens == [2 + int(logits[0, 3] > logits[0, 2]), 3]


# ---- the worker's histories --------------------------------------------------------------

PENALISED = SamplingSpec(presence_penalty=1.0)


LIMITS = PlanLimits(block_size=4, num_blocks=8, vocab_size=VOCAB, max_model_len=32)


def plan(
    chunks: list[tuple[int, list[int], int]],
    new: list[tuple[int, int, list[int]]] | None = None,
    finished: list[int] | None = None,
    spec: SamplingSpec = PENALISED,
) -> StepPlan:
    """(seq_id, tokens, start) chunks, each with block 0 wherever its table reaches (block
    ids are no business of the histories); `new`: (seq_id, prompt_len, prefix)."""
    rows = [
        Row(seq_id, len(tokens), start, blocks=[[0] * -(-(start + len(tokens)) // 4)], blocks_at=0)
        for seq_id, tokens, start in chunks
    ]
    introduced = [
        NewSeq(seq_id, spec, prompt_len, prefix) for seq_id, prompt_len, prefix in new or []
    ]
    input_ids = [t for c in chunks for t in c[1]]
    return StepPlan(0, rows, input_ids, new=introduced, finished=finished or [])


def step(table: SeqTable, plan: StepPlan) -> Histories:
    """The plan applied and its tokens counted, as a runner's step does."""
    table.apply(plan)
    table.histories.count_step(plan)
    return table.histories


def counts_of(tokens: list[int]) -> list[int]:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB).tolist()


def test_histories_count_prompt_and_generated_tokens_across_steps():
    table = SeqTable(LIMITS, CPU)
    prompt = [1, 2, 2, 3, 4, 5]
    # a cache hit of 2 tokens, the rest of the prompt in two chunks, then two decode steps
    step(table, plan([(7, prompt[2:4], 2)], [(7, 6, prompt[:2])]))
    step(table, plan([(7, prompt[4:], 4)]))
    step(table, plan([(7, [9], 6)]))
    histories = step(table, plan([(7, [9], 7), (8, [3, 3], 0)], [(8, 1, [])]))
    found = histories.rows([8, 7])
    assert found is not None and found.rows == [0, 1]
    eight, seven = found.slots.tolist()
    assert found.output_counts[seven].tolist() == counts_of([9, 9])
    assert found.seen[seven].tolist() == [c > 0 for c in counts_of([*prompt, 9])]
    assert found.generated == [[3], [9, 9]]
    assert found.output_counts[eight].tolist() == counts_of([3])


def test_a_released_or_restarted_sequence_starts_afresh():
    table = SeqTable(LIMITS, CPU)
    step(table, plan([(1, [4, 5, 6], 0)], [(1, 2, [])]))
    # preempted, then recomputed from the start: its history begins again
    histories = step(table, plan([(1, [4, 5, 6, 7], 0)], [(1, 2, [])], finished=[1]))
    found = histories.rows([1])
    assert found is not None and found.generated == [[6, 7]]
    assert found.output_counts[found.slots[0]].tolist() == counts_of([6, 7])
    step(table, plan([], finished=[1, 99]))  # an unknown id is no error
    assert histories.rows([1]) is None and len(histories) == 0 and len(table) == 0


def test_a_sequence_never_introduced_is_an_error():
    with pytest.raises(ValueError, match="never introduced"):
        SeqTable(LIMITS, CPU).apply(plan([(3, [1], 0)]))


def test_histories_grow_past_their_first_rows():
    seqs = range(20)
    histories = step(
        SeqTable(LIMITS, CPU), plan([(s, [s], 0) for s in seqs], [(s, 0, []) for s in seqs])
    )
    found = histories.rows(list(seqs))
    assert found is not None
    counts = found.output_counts[found.slots]
    assert [row.nonzero().flatten().tolist() for row in counts] == [[s] for s in seqs]


def test_a_plan_with_histories_crosses_the_wire_unchanged():
    spec = SamplingSpec(
        logit_bias=[(3, 1.5)], bad_words=[[1, 2]], min_tokens=2, min_tokens_stop_ids=[0]
    )
    sent = plan([(4, [1, 2], 3), (5, [6], 0)], [(4, 3, [7, 8, 9]), (5, 1, [])], [2], spec)
    decoded = FrameDecoder().feed(encode_frame(to_message("step", sent)))[0]
    received = step_plan_from_message(decoded)
    assert (received.new[0].prefix, received.finished) == ([7, 8, 9], [2])
    assert received.rows == sent.rows
    assert received.new[0].sampling.logit_bias == [[3, 1.5]]  # JSON's pairs: lists, read alike
    histories = step(SeqTable(LIMITS, CPU), received)
    found = histories.rows([4])
    assert found is not None and found.generated == [[1, 2]]
