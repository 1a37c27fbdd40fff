"""Token sampling for a batch of rows with per-row settings, vectorised over the batch.

Greedy when temperature is 0; otherwise temperature, then top-k, then top-p (both as
transformers' logits warpers define them), then a draw. The draw is the exponential race
argmax(p / E) with E ~ Exp(1), which picks token i with probability p_i and lets each row
take its noise from its own generator: a seeded row's noise comes from a generator seeded
with (seed, absolute position of the sampled token), so it draws the same token whatever
else is in the batch and after being preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.protocol import SamplingSpec

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SampleOutput:
    tokens: list[int]
    logprobs: list[float] | None  # log-probability of each chosen token under the raw logits


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]
    ) -> SampleOutput:
        """logits float32 [S, vocab]; positions[i] is where row i's token will sit."""
        if logits.shape[0] != len(specs) or len(specs) != len(positions):
            raise ValueError(
                f"{logits.shape[0]} logit rows, {len(specs)} specs, {len(positions)} positions"
            )
        if not specs:
            return SampleOutput(tokens=[], logprobs=None)
        tokens = self._choose(logits, specs, positions)
        logprobs = None
        if any(spec.logprobs for spec in specs):
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
        return SampleOutput(tokens=tokens.tolist(), logprobs=logprobs)

    def _choose(
        self, logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]
    ) -> torch.Tensor:
        greedy = [spec.temperature <= 0 for spec in specs]
        best = logits.argmax(dim=-1)
        if all(greedy):
            return best
        temperatures = [
            1.0 if g else spec.temperature for g, spec in zip(greedy, specs, strict=True)
        ]
        scaled = logits / torch.tensor(temperatures, device=logits.device)[:, None]
        scaled = apply_top_k(scaled, [spec.top_k for spec in specs])
        scaled = apply_top_p(scaled, [spec.top_p for spec in specs])
        probs = torch.softmax(scaled, dim=-1)
        drawn = (probs / self._noise(specs, positions, probs.shape)).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=logits.device), best, drawn)

    def _noise(
        self, specs: list[SamplingSpec], positions: list[int], shape: torch.Size
    ) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device)
        unseeded = [i for i, spec in enumerate(specs) if spec.seed is None]
        if unseeded:
            rows = torch.empty((len(unseeded), shape[1]), device=self.device)
            noise[unseeded] = rows.exponential_(generator=self.generator)
        for i, spec in enumerate(specs):
            if spec.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(row_seed(spec.seed, positions[i]))
                noise[i].exponential_(generator=generator)
        # An exact zero would turn a zero probability into 0/0.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def row_seed(seed: int, position: int) -> int:
    """Mixes (seed, position) into one 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def apply_top_k(scores: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keeps each row's k highest scores (ties with the k-th kept); k <= 0 keeps all."""
    vocab = scores.shape[1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return scores
    top = torch.topk(scores, max(ks), dim=-1).values
    index = torch.tensor([k - 1 for k in ks], device=scores.device)[:, None]
    kth = top.gather(1, index)
    keep_all = torch.tensor([k == vocab for k in ks], device=scores.device)[:, None]
    remove = (scores < kth) & ~keep_all
    return scores.masked_fill(remove, float("-inf"))


def apply_top_p(scores: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keeps the smallest set of highest-probability tokens whose mass reaches p (at least one)."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return scores
    sub = scores[rows]
    sorted_scores, sorted_index = torch.sort(sub, dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    threshold = 1.0 - torch.tensor([top_ps[i] for i in rows], device=scores.device)[:, None]
    remove_sorted = cumulative <= threshold
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, sorted_index, remove_sorted)
    scores = scores.clone()
    scores[rows] = sub.masked_fill(remove, float("-inf"))
    return scores
