"""vLLM's logit processors, on a batch of rows at once: each touches only the rows that ask.

In vLLM's order (its v1 Sampler.apply_logits_processors, then min_p after temperature):
1. allowed_token_ids: every other token at -inf;
2. bad words: a word's last token at -inf where the generated tokens end with the rest of
   it (a one-token word always);
3. min_tokens: until that many tokens are generated, the stop tokens at -inf;
4. logit_bias: added to its tokens' logits;
5. penalties: repetition on the tokens of the prompt or generated (a positive logit divided
   by it, a negative one multiplied), then `logits -= frequency * count + presence * (count > 0)`
   over the generated tokens' counts;
6. (sampled rows) min_p: tokens whose probability is below min_p times the row's highest
   at -inf.

A row whose bans (steps 1-3) leave it no token at all, say allowed_token_ids disjoint from
what its grammar allows next, or only stop tokens allowed before min_tokens, takes that
step as if it had asked for no processor: its grammar (applied before) always holds, and
the sampler never draws from an empty distribution.

Steps 1-4 gather (row, token) pairs in Python, a few per row (the words, the biases, the
stop tokens: never the vocabulary or the history), and write them in one indexed operation
each. Step 5 touches only the tokens a penalised row has seen (found on the device, from
the histories' table), since no penalty changes any other.
"""

from __future__ import annotations

import torch

from gpu_worker.host_copies import to_device
from gpu_worker.protocol import SamplingSpec
from gpu_worker.seq_table import RowTokens

_INF = float("inf")


def adjust_logits(
    values: torch.Tensor, specs: list[SamplingSpec], tokens: RowTokens | None
) -> torch.Tensor:
    """Steps 1-5 on float32 values [len(specs), vocab], in place; `tokens` holds the history
    of every row whose spec reads it (rows index into `specs`)."""
    history = {} if tokens is None else {row: i for i, row in enumerate(tokens.rows)}
    banning = [i for i, spec in enumerate(specs) if _bans(spec)]
    before = values[banning] if banning else None  # a copy: advanced indexing
    _keep_allowed(values, specs)
    generated = {row: tokens.generated[i] for row, i in history.items()} if tokens else {}
    _ban(values, _banned_pairs(specs, generated))
    _add_bias(values, specs)
    _penalise(values, specs, tokens, history)
    if before is not None:
        _restore_emptied(values, banning, before)
    return values


def _bans(spec: SamplingSpec) -> bool:
    return spec.allowed_token_ids is not None or bool(spec.bad_words or spec.min_tokens)


def _restore_emptied(values: torch.Tensor, rows: list[int], before: torch.Tensor) -> None:
    """Rows among `rows` left with no finite logit get back their values `before`."""
    index = torch.tensor(rows, device=values.device)
    emptied = ~torch.isfinite(values[index]).any(dim=-1)
    if bool(emptied.any()):
        values[index[emptied]] = before[emptied]


def apply_min_p(scaled: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Keeps the tokens whose probability is at least min_p times the row's most likely
    token's (after temperature, as vLLM); min_p 0 keeps all."""
    rows = [i for i, p in enumerate(min_ps) if p > 0]
    if not rows:
        return scaled
    device = scaled.device
    index = to_device(torch.tensor(rows), device)
    sub = scaled.index_select(0, index)
    probs = torch.softmax(sub, dim=-1)
    min_p = to_device(torch.tensor([min_ps[i] for i in rows], dtype=torch.float32), device)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return scaled.index_copy(0, index, sub.masked_fill(probs < floor, -_INF))


def _keep_allowed(values: torch.Tensor, specs: list[SamplingSpec]) -> None:
    rows = [i for i, spec in enumerate(specs) if spec.allowed_token_ids is not None]
    if not rows:
        return
    device = values.device
    allowed = torch.zeros((len(rows), values.shape[1]), dtype=torch.bool, device=device)
    pairs = [(k, t) for k, i in enumerate(rows) for t in specs[i].allowed_token_ids or ()]
    allowed[_pair_index(pairs, device)] = True
    index = torch.tensor(rows, device=device)
    values[index] = values[index].masked_fill(~allowed, -_INF)


def _banned_pairs(
    specs: list[SamplingSpec], generated_of: dict[int, list[int]]
) -> list[tuple[int, int]]:
    """(row, token) pairs that bad words and min_tokens rule out now; `generated_of` has
    the generated tokens of every row whose spec reads them."""
    pairs: list[tuple[int, int]] = []
    for i, spec in enumerate(specs):
        if not (spec.bad_words or spec.min_tokens):
            continue
        generated = generated_of[i]
        pairs += [(i, word[-1]) for word in spec.bad_words if _ends_with(generated, word[:-1])]
        if len(generated) < spec.min_tokens:
            pairs += [(i, token) for token in spec.min_tokens_stop_ids]
    return pairs


def _ends_with(tokens: list[int], tail: list[int]) -> bool:
    return not tail or (len(tokens) >= len(tail) and tokens[-len(tail) :] == tail)


def _ban(values: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    if pairs:
        values[_pair_index(pairs, values.device)] = -_INF


def _add_bias(values: torch.Tensor, specs: list[SamplingSpec]) -> None:
    pairs = [(i, int(token)) for i, spec in enumerate(specs) for token, _ in spec.logit_bias]
    if not pairs:
        return
    biases = [float(bias) for spec in specs for _, bias in spec.logit_bias]
    bias = torch.tensor(biases, dtype=values.dtype, device=values.device)
    values.index_put_(_pair_index(pairs, values.device), bias, accumulate=True)


def _penalise(
    values: torch.Tensor,
    specs: list[SamplingSpec],
    tokens: RowTokens | None,
    history: dict[int, int],
) -> None:
    rows = [i for i, spec in enumerate(specs) if _penalised(spec)]
    if not rows:
        return
    assert tokens is not None, "penalised rows read their history"
    device = values.device
    slots = tokens.slots[torch.tensor([history[i] for i in rows], device=device)]
    seen = tokens.seen[slots].nonzero()  # [(index in rows, token)] of every seen token
    which, token = seen[:, 0], seen[:, 1]
    counts = tokens.output_counts[slots[which], token].to(values.dtype)
    settings = torch.tensor(
        [
            [specs[i].repetition_penalty, specs[i].frequency_penalty, specs[i].presence_penalty]
            for i in rows
        ],
        dtype=values.dtype,
        device=device,
    )[which]
    row = torch.tensor(rows, device=device)[which]
    found = values[row, token]
    repetition = settings[:, 0]
    found = torch.where(found > 0, found / repetition, found * repetition)
    found = found - settings[:, 1] * counts - settings[:, 2] * (counts > 0)
    values[row, token] = found


def _penalised(spec: SamplingSpec) -> bool:
    return bool(spec.presence_penalty or spec.frequency_penalty or spec.repetition_penalty != 1.0)


def _pair_index(
    pairs: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.tensor(pairs, dtype=torch.long).to(device, non_blocking=True)
    return both[:, 0], both[:, 1]
