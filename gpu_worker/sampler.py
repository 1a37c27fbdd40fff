"""Token sampling for a batch of rows with per-row settings, vectorised over the batch.

Greedy when temperature is 0; otherwise temperature, then top-k, then top-p (both as
transformers' logits warpers define them), then a draw by inverse CDF: one uniform number
per row, looked up in the row's cumulative probabilities. One number per row (rather than
one per vocabulary entry, as torch.multinomial's exponential race draws) keeps sampling
cheap next to the forward pass, and lets each row take it from its own source: a seeded
row's is a function of (seed, absolute position of the sampled token)
(gpu_worker.counter_rng, all seeded rows in one pass), so it draws the same token whatever
else is in the batch and after being preempted and recomputed; the other rows' come from
the worker's generator, one draw for the batch.

On a CUDA device the host waits for the device once per step, where it reads the tokens
back: the rows' settings go to the device through pinned memory (gpu_worker.host_copies),
and the filters use only fixed-shape tensor ops (no boolean indexing, no .item()). Read
back on their own still: the log-probabilities, when a row asks for them, and what the logit
processors below find (rows left with no token, the tokens a penalised row has seen).

Structured output: a row may come with a token bitmask (its grammar's allowed tokens).
Its disallowed logits become -inf before anything else, greedy and its log-probabilities
included (as vLLM's: those of the distribution it samples from); rows without one take the
same path, at the same cost, as when no row has a mask.

Then vLLM's logit processors (gpu_worker.logit_processors: allowed tokens, bad words,
min_tokens, logit_bias, penalties; min_p after temperature), on the rows that ask for them,
greedy ones too. Log-probabilities stay those before them (vLLM's default "raw_logprobs").
Rows that ask for none take the same path as when no row asks.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.counter_rng import as_int64, seeded_uniforms
from gpu_worker.host_copies import to_device, to_host_list
from gpu_worker.logit_processors import adjust_logits, apply_min_p
from gpu_worker.protocol import SamplingSpec, TokenLogprobs
from gpu_worker.seq_table import RowTokens

MIN_LOGPROB = -9999.0  # what vLLM reports for a token its grammar rules out


@dataclass(slots=True)
class Logits:
    """The LM head's output for the rows that sample.

    `values` are in the model's dtype. In bfloat16 the few best candidates of each row are
    recomputed in float32 (`top` token ids, `top_values`; see Model.logits): greedy rows
    then need no float32 copy of the whole [rows, vocab] matrix, which costs more on a CPU
    than the argmax itself.
    """

    values: torch.Tensor  # [S, vocab]
    top: torch.Tensor | None = None  # [S, k] token ids
    top_values: torch.Tensor | None = None  # [S, k] float32
    # [S] each row's argmax token, computed with the logits: inside a decode graph, so a
    # greedy step launches nothing after the replay but the tokens' copy
    best_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.best_ids is None:
            self.best_ids = self._argmax()

    def dense(self) -> torch.Tensor:
        """float32 [S, vocab], with the refined values in place."""
        dense = self.values.float()
        if self.top is None or self.top_values is None:
            return dense
        return dense.scatter_(1, self.top, self.top_values)

    def best(self) -> torch.Tensor:
        """The argmax token of each row."""
        assert self.best_ids is not None  # set at construction
        return self.best_ids

    def _argmax(self) -> torch.Tensor:
        if self.top is None or self.top_values is None:
            return self.values.argmax(dim=-1)
        return self.top.gather(1, self.top_values.argmax(dim=-1, keepdim=True))[:, 0]

    def select(self, rows: list[int] | slice | torch.Tensor) -> Logits:
        """Some rows: a tensor of row indices on the logits' device is read without a
        host-to-device copy (a list's is, and on CUDA it waits for the device)."""
        assert self.best_ids is not None
        if self.top is None or self.top_values is None:
            return Logits(self.values[rows], best_ids=self.best_ids[rows])
        return Logits(self.values[rows], self.top[rows], self.top_values[rows], self.best_ids[rows])

    def fields(self) -> dict[str, torch.Tensor]:
        """The tensors it holds, by name (a graph's outputs are copied field by field)."""
        return {
            field.name: value
            for field in dataclasses.fields(self)
            if (value := getattr(self, field.name)) is not None
        }

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]


@dataclass(slots=True)
class SampleOutput:
    tokens: list[int]
    logprobs: TokenLogprobs | None  # of each chosen token and its alternatives, raw logits


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(
        self,
        logits: Logits | torch.Tensor,
        specs: list[SamplingSpec],
        positions: list[int],
        bitmasks: list[torch.Tensor | None] | None = None,
        history: RowTokens | None = None,
    ) -> SampleOutput:
        """positions[i] is where row i's token will sit; bitmasks[i], if given and not
        None, the int32 words of the tokens row i may take (see Row.bitmask);
        `history`, the tokens so far of the rows whose specs read them (gpu_worker.seq_table)."""
        if isinstance(logits, torch.Tensor):
            logits = Logits(logits)
        if logits.num_rows != len(specs) or len(specs) != len(positions):
            raise ValueError(
                f"{logits.num_rows} logit rows, {len(specs)} specs, {len(positions)} positions"
            )
        if bitmasks and len(bitmasks) != len(specs):
            raise ValueError(f"{len(specs)} rows but {len(bitmasks)} bitmasks")
        if not specs:
            return SampleOutput(tokens=[], logprobs=None)
        masked = _Masked.of(logits, bitmasks or [])
        tokens = self._choose(
            logits, specs, positions, with_processors(logits, masked, specs, history)
        )
        logprobs = None
        if any(spec.logprobs for spec in specs):
            tops = [spec.top_logprobs if spec.logprobs else 0 for spec in specs]
            logprobs = token_logprobs(_dense(logits, masked), tokens, tops)
        return SampleOutput(tokens=to_host_list(tokens), logprobs=logprobs)

    def _choose(
        self,
        logits: Logits,
        specs: list[SamplingSpec],
        positions: list[int],
        masked: _Masked | None,
    ) -> torch.Tensor:
        best = logits.best()
        device = logits.values.device
        if masked is not None:  # out of place: best() may be a graph's output
            best = best.index_put((masked.index,), masked.values.argmax(dim=-1))
        if all(spec.temperature <= 0 for spec in specs):
            return best
        temperatures = to_device(
            torch.tensor([s.temperature for s in specs], dtype=torch.float32), device
        )
        greedy = temperatures <= 0
        scaled = _dense(logits, masked) / torch.where(greedy, 1.0, temperatures)[:, None]
        scaled = apply_min_p(scaled, [spec.min_p for spec in specs])
        scaled = apply_top_k(scaled, [spec.top_k for spec in specs])
        scaled = apply_top_p(scaled, [spec.top_p for spec in specs])
        cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
        # Scaled by each row's total so float rounding in the cumsum cannot leave a gap.
        targets = self._uniforms(specs, positions)[:, None] * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, targets, right=True)[:, 0]
        drawn = torch.where(drawn < cdf.shape[1], drawn, scaled.argmax(dim=-1))
        return torch.where(greedy, best, drawn)

    def _uniforms(self, specs: list[SamplingSpec], positions: list[int]) -> torch.Tensor:
        """One U[0, 1) number per row: seeded rows' from (seed, position), the others' from
        the worker's generator."""
        drawn = torch.rand(len(specs), generator=self.generator, device=self.device)
        if all(spec.seed is None for spec in specs):
            return drawn
        keys = [
            [as_int64(spec.seed or 0) for spec in specs],
            positions,
            [spec.seed is not None for spec in specs],
        ]
        seeds, at, seeded = to_device(torch.tensor(keys, dtype=torch.int64), self.device)
        return torch.where(seeded.bool(), seeded_uniforms(seeds, at), drawn)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, tops: list[int]) -> TokenLogprobs:
    """float32 logits [S, vocab] -> each row's log-probability of its target token and of
    its tops[row] most likely tokens; at least MIN_LOGPROB (a masked token's), since JSON
    has no -inf."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = to_host_list(log_probs.gather(1, targets[:, None])[:, 0].clamp(min=MIN_LOGPROB))
    k = min(max(tops, default=0), log_probs.shape[1])
    if k == 0:
        return TokenLogprobs(chosen, [[] for _ in tops], [[] for _ in tops])
    best = log_probs.topk(k, dim=-1)
    ids, values = to_host_list(best.indices), to_host_list(best.values.clamp(min=MIN_LOGPROB))
    return TokenLogprobs(
        chosen,
        [row[:top] for row, top in zip(ids, tops, strict=True)],
        [row[:top] for row, top in zip(values, tops, strict=True)],
    )


def decode_bitmask(text: str) -> torch.Tensor:
    """A plan's base64 bitmask -> its int32 words."""
    words = np.frombuffer(base64.b64decode(text), dtype="<i4").astype(np.int32)
    return torch.from_numpy(words)


def allowed_tokens(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask words -> bool [vocab]: bit j of word w allows token 32 * w + j."""
    if words.numel() * 32 < vocab:
        raise ValueError(f"a bitmask of {words.numel()} words cannot cover {vocab} tokens")
    # numpy's unpackbits: one call, no torch thread pool (which a tiny op only waits on)
    data = np.asarray(words.cpu().numpy(), dtype="<i4").view(np.uint8)
    return torch.from_numpy(np.unpackbits(data, bitorder="little")[:vocab].view(np.bool_))


@dataclass(slots=True)
class _Masked:
    """The float32 logits of the rows with a bitmask, disallowed tokens at -inf."""

    rows: list[int]  # row indices
    index: torch.Tensor  # the same, on the logits' device
    values: torch.Tensor  # [len(rows), vocab]

    @classmethod
    def of(cls, logits: Logits, bitmasks: list[torch.Tensor | None]) -> _Masked | None:
        masked = [(i, words) for i, words in enumerate(bitmasks) if words is not None]
        if not masked:
            return None
        rows = [i for i, _ in masked]
        device = logits.values.device
        vocab = logits.values.shape[1]
        allowed = to_device(
            torch.stack([allowed_tokens(words, vocab) for _, words in masked]), device
        )
        index = row_index(rows, device)
        # out of place: float32 values come back from dense() uncopied
        values = logits.select(index).dense().masked_fill(~allowed, float("-inf"))
        return cls(rows, index, values)


def with_processors(
    logits: Logits, masked: _Masked | None, specs: list[SamplingSpec], history: RowTokens | None
) -> _Masked | None:
    """`masked` with the logit processors applied: the rows with a grammar mask or a
    processor (before temperature), their float32 values adjusted; `masked` itself when no
    row has a processor."""
    adjusted = [i for i, spec in enumerate(specs) if spec.adjusts_logits]
    if not adjusted:
        return masked
    masked_rows = [] if masked is None else masked.rows
    rows = sorted(set(adjusted).union(masked_rows))
    at = {row: k for k, row in enumerate(rows)}
    device = logits.values.device
    index = row_index(rows, device)
    values = logits.select(index).dense()
    if masked is not None:
        values[row_index([at[row] for row in masked_rows], device)] = masked.values
    if history is not None:
        history = dataclasses.replace(history, rows=[at[row] for row in history.rows])
    values = adjust_logits(values, [specs[row] for row in rows], history)
    return _Masked(rows, index, values)


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices as an int64 tensor on `device`, sent without waiting for it."""
    return to_device(torch.tensor(rows, dtype=torch.int64), device)


def _dense(logits: Logits, masked: _Masked | None) -> torch.Tensor:
    """float32 [S, vocab]: the masked rows' values in place of theirs."""
    dense = logits.dense()
    return dense if masked is None else dense.index_put((masked.index,), masked.values)


def apply_top_k(scores: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keeps each row's k highest scores (ties with the k-th kept); k <= 0 or >= vocab keeps
    all. Only the largest k that cuts is searched for, whatever the rows that keep all."""
    vocab = scores.shape[1]
    cuts = [k for k in top_ks if 0 < k < vocab]
    if not cuts:
        return scores
    widest = max(cuts)
    ks = to_device(torch.tensor(top_ks), scores.device)
    top = torch.topk(scores, widest, dim=-1).values
    kth = top.gather(1, ks.clamp(1, widest)[:, None] - 1)
    kth = kth.masked_fill(((ks <= 0) | (ks >= vocab))[:, None], float("-inf"))
    return scores.masked_fill(scores < kth, float("-inf"))


def apply_top_p(scores: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keeps the smallest set of highest-probability tokens whose mass reaches p (at least one).

    Tokens tied with the least probable kept token are kept too.
    """
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return scores
    device = scores.device
    index = row_index(rows, device)
    sub = scores.index_select(0, index)
    probs = torch.softmax(sub, dim=-1)
    floor = _nucleus_floor(
        probs, to_device(torch.tensor([top_ps[i] for i in rows], dtype=torch.float32), device)
    )
    return scores.index_copy(0, index, sub.masked_fill(probs < floor[:, None], float("-inf")))


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the probability of the least probable token of the nucleus.

    On a CUDA device, from each whole row sorted (as vLLM's top-p): a search that stops
    early must learn which rows are done, a wait on the device. On the CPU, where nothing is
    waited for and a sort of the whole vocabulary costs more than the rest of the sampling,
    the staged search.
    """
    if probs.device.type == "cpu":
        return staged_nucleus_floor(probs, top_p)
    return sorted_nucleus_floor(probs, top_p)


def sorted_nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """_nucleus_floor's answer from each whole row sorted: the same ops whatever the rows."""
    return _floor_within(probs.sort(dim=-1, descending=True).values, top_p)[0]


def staged_nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """_nucleus_floor's answer found in each row's top 64, then top 1024, and only where the
    nucleus is wider still in the whole row sorted: a nucleus usually lies within a few
    dozen tokens."""
    vocab = probs.shape[1]
    floor = torch.empty(probs.shape[0], device=probs.device)
    pending = torch.arange(probs.shape[0], device=probs.device)
    for k in (64, 1024):
        if k >= vocab:
            break
        found_floor, found = _floor_within(probs[pending].topk(k, dim=-1).values, top_p[pending])
        floor[pending[found]] = found_floor[found]
        pending = pending[~found]
        if pending.numel() == 0:
            return floor
    floor[pending] = sorted_nucleus_floor(probs[pending], top_p[pending])
    return floor


def _floor_within(top: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' highest probabilities, in descending order -> the nucleus floor found among
    them, and whether the nucleus ends there (their mass reaches p)."""
    cumulative = top.cumsum(dim=-1)
    # A token belongs to the nucleus when the mass before it is below p.
    # At least the top token: a p too small for float32 (5e-324) would keep none.
    kept = ((cumulative - top) < top_p[:, None]).sum(dim=-1).clamp(min=1)
    return top.gather(1, (kept - 1)[:, None])[:, 0], cumulative[:, -1] >= top_p
