"""Structured output in the worker: a row's token bitmask limits what it samples, greedy or
not, and leaves the other rows of its batch exactly as they would be without it."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from gpu_worker.protocol import (
    FrameDecoder,
    SamplingSpec,
    encode_frame,
    step_plan_from_message,
    to_message,
)
from gpu_worker.sampler import MIN_LOGPROB, Logits, Sampler, allowed_tokens, decode_bitmask
from tests.worker_fixtures import (
    Chunk,
    blocks_for,
    make_plan,
    make_runner,
    random_prompt,
    sampled,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 50  # not a multiple of 32: the last word's high bits lie past the vocabulary
CPU = torch.device("cpu")


def words_allowing(tokens: set[int], vocab: int = VOCAB) -> torch.Tensor:
    words = np.zeros(-(-vocab // 32), dtype=np.uint32)
    for token in tokens:
        words[token // 32] |= np.uint32(1 << (token % 32))
    return torch.from_numpy(words.view(np.int32).copy())


def as_text(words: torch.Tensor) -> str:
    """As the service sends it (BatchPlan.token_bitmasks)."""
    return base64.b64encode(np.asarray(words.numpy(), dtype="<i4").tobytes()).decode()


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def spec(temperature: float = 0.0, **kw) -> SamplingSpec:
    return SamplingSpec(temperature=temperature, **kw)


def test_bits_map_to_tokens_little_end_first_and_the_sign_bit_counts():
    allowed = {0, 5, 31, 32, 49}  # 31 is the sign bit of the first int32 word
    words = words_allowing(allowed)
    assert words[0].item() < 0
    mask = allowed_tokens(decode_bitmask(as_text(words)), VOCAB)
    assert mask.shape == (VOCAB,) and set(mask.nonzero()[:, 0].tolist()) == allowed
    with pytest.raises(ValueError, match="cannot cover"):
        allowed_tokens(words[:1], VOCAB)


def test_greedy_masked_rows_take_their_best_allowed_token_and_others_are_unchanged():
    logits = random_logits(4, seed=0)
    allowed = [None, {3, 17, 40}, None, {int(logits[3].argmin())}]
    masks = [None if a is None else words_allowing(a) for a in allowed]
    specs = [spec()] * 4
    free = Sampler(0, CPU).sample(logits, specs, [0] * 4).tokens
    out = Sampler(0, CPU).sample(logits, specs, [0] * 4, masks).tokens
    assert out[1] == max(allowed[1], key=lambda t: logits[1, t].item())
    assert out[3] == int(logits[3].argmin())  # the only token allowed, however unlikely
    assert (out[0], out[2]) == (free[0], free[2])


def test_a_masked_greedy_row_of_refined_logits_ignores_a_disallowed_best_candidate():
    values = torch.tensor([[9.0, 8.0, 1.0, 7.0]], dtype=torch.bfloat16)
    logits = Logits(values, top=torch.tensor([[0, 1]]), top_values=torch.tensor([[9.1, 8.2]]))
    out = Sampler(0, CPU).sample(logits, [spec()], [0], [words_allowing({2, 3}, 4)])
    assert logits.best().tolist() == [0] and out.tokens == [3]


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_masked_rows_stay_in_their_mask_and_others_draw_as_without_masks(seeded: bool):
    logits = random_logits(1, seed=1).expand(3, -1)
    allowed = {2, 9, 33, 48}
    kw = {"seed": 7} if seeded else {}
    specs = [spec(1.5, **kw), spec(1.5, top_k=20, top_p=0.95, **kw), spec(1.5, **kw)]
    masks = [None, words_allowing(allowed), words_allowing(allowed)]
    drawn_free, drawn_masked = [], []
    plain, constrained = Sampler(3, CPU), Sampler(3, CPU)
    for position in range(300):
        positions = [position] * 3
        drawn_free.append(plain.sample(logits, specs, positions).tokens)
        drawn_masked.append(constrained.sample(logits, specs, positions, masks).tokens)
    assert [row[0] for row in drawn_masked] == [row[0] for row in drawn_free]
    for column in (1, 2):
        tokens = {row[column] for row in drawn_masked}
        assert tokens <= allowed and len(tokens) > 1  # sampled, not collapsed to one token
    # without the mask the same rows draw outside it
    assert {row[2] for row in drawn_free} - allowed


def test_logprobs_of_masked_rows_are_those_of_the_distribution_sampled_from():
    """As vLLM's: the mask applies before the log-softmax, so a masked row's chosen token and
    alternatives are those its grammar allows, and its probabilities sum to one over them."""
    logits = random_logits(2, seed=2)
    masks = [words_allowing({4, 5}), None]
    specs = [spec(1.0, logprobs=True, top_logprobs=3), spec(logprobs=True, top_logprobs=3)]
    out = Sampler(0, CPU).sample(logits, specs, [0, 0], masks)
    allowed = torch.full_like(logits[0], float("-inf"))
    allowed[[4, 5]] = logits[0, [4, 5]]
    masked = torch.log_softmax(allowed, -1)
    raw = torch.log_softmax(logits[1], -1)
    assert out.tokens[0] in {4, 5} and out.logprobs is not None
    assert out.logprobs.logprobs == pytest.approx(
        [masked[out.tokens[0]].item(), raw[out.tokens[1]].item()], abs=1e-6
    )
    assert set(out.logprobs.top_ids[0][:2]) == {4, 5}
    assert out.logprobs.top_logprobs[0][2] == MIN_LOGPROB  # JSON has no -inf
    assert out.logprobs.top_ids[1] == raw.topk(3).indices.tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_plan_carries_masks_to_the_runner_through_the_wire(tiny_llama_dir, dtype):
    runner = make_runner(tiny_llama_dir, dtype=dtype)
    prompts = [random_prompt(9, seed=1), random_prompt(6, seed=2)]
    chunks = [Chunk(0, prompts[0], 0, blocks_for(0, 10)), Chunk(1, prompts[1], 0, [10, 11])]
    free = sampled(runner.execute(make_plan(chunks)))
    runner = make_runner(tiny_llama_dir, dtype=dtype)  # a fresh cache: the same prefill again
    allowed = set(range(100, 256, 7)) - {free[1]}
    chunks[1].bitmask = as_text(words_allowing(allowed, 256))
    plan = make_plan(chunks)
    decoded = FrameDecoder().feed(encode_frame(to_message("step", plan)))[0]
    result = runner.execute(step_plan_from_message(decoded))
    tokens = sampled(result)
    assert tokens[0] == free[0] and tokens[1] in allowed
