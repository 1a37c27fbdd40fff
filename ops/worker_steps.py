"""Steps of a ModelRunner as the device check's sections, the benches and the worker tests
build them: a sequence's part of a step (Seq), the plan of several (plan_of), and the runs
and comparisons made of them. It imports torch and gpu_worker only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpu_worker.protocol import BatchPlan, SamplingSpec
from gpu_worker.runner import ModelRunner


@dataclass(slots=True)
class Seq:
    """One sequence's part of a step."""

    seq_id: int
    tokens: list[int]
    start: int
    table: list[int]
    sample: bool = True
    spec: SamplingSpec = field(default_factory=SamplingSpec)


def plan_of(seqs: list[Seq], step_id: int = 0, num_groups: int = 1) -> BatchPlan:
    """The step of `seqs`. On a cache of `num_groups` KV groups (a hybrid model's), entry
    b of a table is block b x num_groups + g in group g: no two groups share a block."""

    def spread(table: list[int], group: int) -> list[int]:
        return [block * num_groups + group for block in table]

    return BatchPlan(
        step_id=step_id,
        seq_ids=[s.seq_id for s in seqs],
        num_tokens=[len(s.tokens) for s in seqs],
        start_pos=[s.start for s in seqs],
        input_ids=[t for s in seqs for t in s.tokens],
        block_tables=[spread(s.table, 0) for s in seqs],
        group_tables=[[spread(s.table, g) for g in range(1, num_groups)] for s in seqs]
        if num_groups > 1
        else [],
        sample=[s.sample for s in seqs],
        sampling=[s.spec for s in seqs],
    )


class Blocks:
    """Hands out consecutive block ids (a section's sequences never share blocks)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next = 0

    def take(self, tokens: int) -> list[int]:
        count = -(-tokens // self.block_size)
        self.next += count
        return list(range(self.next - count, self.next))


def tokens_of(count: int, seed: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=generator).tolist()


def execute(runner: ModelRunner, seqs: list[Seq]) -> list[int]:
    result = runner.execute(plan_of(seqs))
    if result.error is not None:
        raise RuntimeError(result.error)
    return [row[0] for row in result.tokens]  # one token per sampled sequence


def prefill(runner: ModelRunner, seq: Seq, chunk: int) -> torch.Tensor:
    """Feeds seq.tokens from seq.start in chunks of `chunk`; the last one's logits [vocab]."""
    for first in range(0, len(seq.tokens), chunk):
        part = seq.tokens[first : first + chunk]
        last = first + chunk >= len(seq.tokens)
        plan = plan_of([Seq(seq.seq_id, part, seq.start + first, seq.table, sample=last)])
        logits = runner.step_logits(plan)
    return logits[0]


def greedy(
    runner: ModelRunner,
    seq: Seq,
    steps: int,
    company: Callable[[int], list[Seq]] = lambda step: [],
) -> list[int]:
    """Prefills seq, then decodes `steps` tokens, each step beside company(step)."""
    out = execute(runner, [seq])
    for step in range(steps - 1):
        position = seq.start + len(seq.tokens) + step
        decode = Seq(seq.seq_id, [out[-1]], position, seq.table)
        out.append(execute(runner, [decode, *company(step)])[0])
    return out


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    got, want = got.float().cpu(), want.float().cpu()
    return {
        "max_abs_diff": round((got - want).abs().max().item(), 6),
        "argmax_agreement": round((got.argmax(-1) == want.argmax(-1)).float().mean().item(), 4),
    }
