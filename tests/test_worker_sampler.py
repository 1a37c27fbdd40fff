"""The sampler: greedy, temperature, top-k, top-p, logprobs (seeds: its _seeded tests)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_worker import sampler as sampler_module
from gpu_worker.protocol import SamplingSpec
from gpu_worker.sampler import (
    Logits,
    Sampler,
    apply_top_k,
    apply_top_p,
    sorted_nucleus_floor,
    staged_nucleus_floor,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draw(logits: torch.Tensor, spec: SamplingSpec, times: int, seed: int = 0) -> list[int]:
    sampler = Sampler(seed, torch.device("cpu"))
    batch = logits.expand(times, -1)
    return sampler.sample(batch, [spec] * times, list(range(times))).tokens


def test_greedy_is_argmax():
    logits = random_logits(6)
    out = Sampler(0, torch.device("cpu")).sample(logits, [SamplingSpec()] * 6, [0] * 6)
    assert out.tokens == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_refined_candidates_break_ties_of_low_precision_logits():
    values = torch.tensor([[25.375, 25.375, 3.0, 25.0]], dtype=torch.bfloat16)
    refined = Logits(values, top=torch.tensor([[0, 1]]), top_values=torch.tensor([[25.31, 25.33]]))
    assert refined.best().tolist() == [1]  # the bfloat16 argmax alone says 0
    dense = refined.dense()
    assert dense.dtype == torch.float32
    assert dense[0].tolist() == pytest.approx([25.31, 25.33, 3.0, 25.0])
    out = Sampler(0, torch.device("cpu")).sample(refined, [SamplingSpec(logprobs=True)], [0])
    assert out.tokens == [1]
    assert out.logprobs is not None
    assert out.logprobs.logprobs == pytest.approx([torch.log_softmax(dense, -1)[0, 1].item()])


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = random_logits(1)[0]
    tokens = draw(logits, SamplingSpec(temperature=5.0, top_k=1), times=200)
    assert set(tokens) == {int(logits.argmax())}


def test_top_k_keeps_only_the_k_best():
    logits = random_logits(1)[0]
    best = set(torch.topk(logits, 5).indices.tolist())
    tokens = draw(logits, SamplingSpec(temperature=3.0, top_k=5), times=500)
    assert set(tokens) <= best and len(set(tokens)) > 1


def test_top_p_restricts_the_support_to_the_nucleus():
    logits = random_logits(1, seed=1)[0]
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    nucleus = set(order[: int((cumulative < 0.6).sum()) + 1].tolist())
    tokens = draw(logits, SamplingSpec(temperature=1.0, top_p=0.6), times=1000)
    assert set(tokens) <= nucleus
    assert len(set(tokens)) > 1 or len(nucleus) == 1


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-300])
def test_a_top_p_below_float32_keeps_the_most_probable_token(top_p: float):
    logits = random_logits(3, seed=2)
    out = Sampler(0, torch.device("cpu")).sample(
        logits, [SamplingSpec(temperature=1.0, top_p=top_p)] * 3, [0, 1, 2]
    )
    assert out.tokens == logits.argmax(dim=-1).tolist()


def test_unrestricted_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2] + [1e-9] * (VOCAB - 3)))
    tokens = draw(logits, SamplingSpec(temperature=1.0), times=4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / len(tokens)
    assert torch.allclose(counts[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_filters_apply_per_row_and_leave_other_rows_alone():
    scores = random_logits(3)
    filtered = apply_top_k(scores, [0, 2, 0])
    assert torch.equal(filtered[0], scores[0]) and torch.equal(filtered[2], scores[2])
    assert torch.isfinite(filtered[1]).sum() == 2
    nucleus = apply_top_p(scores, [1.0, 1e-6, 1.0])
    assert torch.equal(nucleus[0], scores[0]) and torch.equal(nucleus[2], scores[2])
    assert torch.isfinite(nucleus[1]).sum() == 1  # at least one token always stays


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = random_logits(4)
    specs = [SamplingSpec(logprobs=True), SamplingSpec(temperature=0.7, logprobs=True)] * 2
    out = Sampler(0, torch.device("cpu")).sample(logits, specs, [0] * 4)
    expected = torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor(out.tokens)]
    assert out.logprobs is not None
    assert out.logprobs.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert out.logprobs.top_ids == [[]] * 4  # none asked for alternatives


def test_top_logprobs_are_each_rows_k_best_of_the_raw_logits():
    logits = random_logits(3)
    specs = [
        SamplingSpec(logprobs=True, top_logprobs=5),
        SamplingSpec(temperature=0.7, seed=3, logprobs=True, top_logprobs=20),
        SamplingSpec(),  # asks for nothing: its row carries no alternatives
    ]
    out = Sampler(0, torch.device("cpu")).sample(logits, specs, [0] * 3)
    assert out.logprobs is not None
    log_probs = torch.log_softmax(logits, -1)
    for row, k in ((0, 5), (1, 20)):
        best = log_probs[row].topk(k)
        assert out.logprobs.top_ids[row] == best.indices.tolist()
        assert out.logprobs.top_logprobs[row] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert out.logprobs.top_ids[0][0] == out.tokens[0]  # greedy takes the best alternative
    assert out.logprobs.top_ids[2] == [] and out.logprobs.top_logprobs[2] == []


def test_mismatched_inputs_are_rejected():
    with pytest.raises(ValueError, match="logit rows"):
        Sampler(0, torch.device("cpu")).sample(random_logits(2), [SamplingSpec()], [0])


def nucleus_by_full_sort(scores: torch.Tensor, top_p: float) -> set[int]:
    probs = scores.softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    return set(order[before < top_p].tolist())


def test_nucleus_search_matches_a_full_sort_for_narrow_and_wide_nuclei():
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(3, 5000, generator=generator)
    scores = base * torch.tensor([[8.0], [1.5], [0.2]])  # narrow, middling, wide nucleus
    filtered = apply_top_p(scores, [0.9, 0.9, 0.9])
    sizes = []
    for row in range(3):
        kept = set(torch.isfinite(filtered[row]).nonzero()[:, 0].tolist())
        assert kept == nucleus_by_full_sort(scores[row], 0.9)
        sizes.append(len(kept))
    assert sizes[0] < 64 < sizes[1] or sizes[1] > 1024
    assert sizes[2] > 1024


# The filters as they were before issue 51 moved sampling onto the device (boolean indexing,
# a top-k over the whole vocabulary when any row kept all), kept as the reference the
# rewritten ones must equal.
def previous_top_k(scores: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = scores.shape[1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return scores
    top = torch.topk(scores, max(ks), dim=-1).values
    kth = top.gather(1, torch.tensor([k - 1 for k in ks])[:, None])
    keep_all = torch.tensor([k == vocab for k in ks])[:, None]
    return scores.masked_fill((scores < kth) & ~keep_all, float("-inf"))


def previous_top_p(scores: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return scores
    sub = scores[rows]
    probs = torch.softmax(sub, dim=-1)
    floor = previous_nucleus_floor(probs, torch.tensor([top_ps[i] for i in rows]))
    scores = scores.clone()
    scores[rows] = sub.masked_fill(probs < floor[:, None], float("-inf"))
    return scores


def previous_nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = probs.shape[1]
    floor = torch.empty(probs.shape[0])
    pending = torch.arange(probs.shape[0])
    for k in (64, 1024, vocab):
        candidates = probs[pending]
        if k < vocab:
            top = candidates.topk(k, dim=-1).values
        else:
            top = candidates.sort(dim=-1, descending=True).values
        cumulative = top.cumsum(dim=-1)
        wanted = top_p[pending]
        kept = ((cumulative - top) < wanted[:, None]).sum(dim=-1).clamp(min=1)
        found = (cumulative[:, -1] >= wanted) | (k >= vocab)
        floor[pending[found]] = top.gather(1, (kept - 1)[:, None])[found, 0]
        pending = pending[~found]
        if pending.numel() == 0:
            break
    return floor


@pytest.mark.parametrize("vocab", [50, 3000])
def test_top_p_equals_the_previous_implementation_on_random_rows(vocab: int):
    generator = torch.Generator().manual_seed(vocab)
    # scales from a nucleus of a few tokens to one wider than 1024 (for vocab 3000)
    scales = torch.tensor([12.0, 6.0, 3.0, 1.5, 0.8, 0.3, 0.1, 0.02, 2.0, 1.0])[:, None]
    scores = torch.randn(10, vocab, generator=generator) * scales
    scores[3, :7] = scores[3, 0]  # ties at the top
    top_ps = torch.rand(10, generator=generator).tolist()
    top_ps[4] = 1.0  # rows that keep all stay as they are
    top_ps[8] = 1e-30
    assert torch.equal(apply_top_p(scores, top_ps), previous_top_p(scores, top_ps))
    probs = scores.softmax(-1)
    wanted = torch.tensor(top_ps)
    staged = staged_nucleus_floor(probs, wanted)
    assert torch.equal(staged, previous_nucleus_floor(probs, wanted))
    assert torch.equal(sorted_nucleus_floor(probs, wanted), staged)  # the device's way


def test_top_k_equals_the_previous_implementation_on_random_rows():
    scores = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(8)) * 3
    scores[2, :4] = scores[2, 0]  # ties with the k-th
    for top_ks in ([0, 1, 3, 49, 50, 60, 4, 0], [5] * 8, [0, VOCAB, 2, 0, 0, 0, 0, 0]):
        assert torch.equal(apply_top_k(scores, top_ks), previous_top_k(scores, top_ks))


# Operators that make the host wait for a CUDA device: a tensor's value read on the host,
# or a result whose size depends on the values (boolean indexing, nonzero).
WAITING_OPERATORS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero")


class WaitLog(TorchDispatchMode):
    """Records the operators dispatched inside it that would wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        indices = args[1] if name.startswith("aten::index") and len(args) > 1 else ()
        if any(mark in name for mark in WAITING_OPERATORS) or any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()
        ):
            self.waits.append(name)
        return func(*args, **(kwargs or {}))


def test_a_sampled_step_on_the_devices_path_waits_for_the_device_nowhere(monkeypatch):
    # top-p as a CUDA device runs it (the CPU's staged search indexes by what it found)
    monkeypatch.setattr(sampler_module, "staged_nucleus_floor", sampler_module.sorted_nucleus_floor)
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(6)) * 0.5
    specs = [
        SamplingSpec(),
        SamplingSpec(temperature=0.9, seed=4),
        SamplingSpec(temperature=1.1, top_k=40),
        SamplingSpec(temperature=1.0, top_p=0.95, seed=5),  # a nucleus past 1024 tokens
        SamplingSpec(temperature=0.8, min_p=0.05),
        SamplingSpec(temperature=1.0, top_p=0.5, top_k=2000),
    ]
    words = torch.full((3000 // 32 + 1,), -1, dtype=torch.int32)  # a grammar allowing all
    with WaitLog() as log:
        tokens = Sampler(0, torch.device("cpu")).sample(
            logits, specs, [10] * 6, [None, words, None, None, None, None]
        )
    assert log.waits == []
    assert len(tokens.tokens) == 6
