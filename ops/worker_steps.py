"""Steps of a ModelRunner as the device check's sections, the benches and the worker tests
build them: a sequence's part of a step (Seq), the plan of several (plan_of), and the runs
and comparisons made of them. It imports torch and gpu_worker only."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpu_worker.protocol import NewSeq, Row, SamplingSpec, StepPlan
from gpu_worker.runner import ModelRunner


@dataclass(slots=True)
class Seq:
    """One sequence's part of a step, described whole: its table is every block it has."""

    seq_id: int
    tokens: list[int]
    start: int
    table: list[int]
    sample: bool = True
    spec: SamplingSpec = field(default_factory=SamplingSpec)
    prompt_len: int | None = None  # None: its tokens to the end of this part are prompt
    prefix: list[int] = field(default_factory=list)  # NewSeq.prefix, when it is introduced
    drafts: list[int] = field(default_factory=list)  # the last of `tokens` (Row.drafts)
    bitmask: str | None = None
    prompt_targets: list[int] | None = None
    pooling: str | None = None  # NewSeq.pooling, when it is introduced
    adapter: str | None = None  # NewSeq.adapter (its LoRA adapter's name), when introduced


@dataclass(slots=True)
class _Held:
    spec: SamplingSpec
    table: list[int]
    adapter: str | None = None


class Steps:
    """Plans for one worker from whole descriptions of its sequences, as the service's
    PlanBuilder writes them: a sequence is introduced when it is new to the worker, has
    other sampling settings or adapter, or starts again at position 0 (then finished first), and
    otherwise its row carries the blocks its table gained (or from where it changed)."""

    def __init__(self, num_groups: int = 1) -> None:
        self.num_groups = num_groups
        self._held: dict[int, _Held] = {}

    def plan(self, seqs: list[Seq], step_id: int = 0, standalone: bool = False) -> StepPlan:
        """The step of `seqs`; `standalone`: every one introduced afresh, so that the plan
        does not depend on what the worker held before."""
        new, finished, rows = [], [], []
        for seq in seqs:
            held = None if standalone else self._held.get(seq.seq_id)
            if (
                held is None
                or (held.spec, held.adapter) != (seq.spec, seq.adapter)
                or seq.start == 0
            ):
                finished.append(seq.seq_id)
                prompt_len = (
                    seq.start + len(seq.tokens) if seq.prompt_len is None else seq.prompt_len
                )
                new.append(
                    NewSeq(
                        seq.seq_id,
                        seq.spec,
                        prompt_len,
                        list(seq.prefix),
                        seq.pooling,
                        adapter=seq.adapter,
                    )
                )
                held = _Held(seq.spec, [])
            at = _common_prefix(held.table, seq.table)
            added = seq.table[at:]
            blocks = [self._spread(added, g) for g in range(self.num_groups)] if added else []
            rows.append(
                Row(
                    seq.seq_id,
                    len(seq.tokens),
                    seq.start,
                    blocks=blocks,
                    blocks_at=at,
                    sample=seq.sample,
                    drafts=list(seq.drafts),
                    bitmask=seq.bitmask,
                    prompt_targets=seq.prompt_targets,
                )
            )
            self._held[seq.seq_id] = _Held(seq.spec, list(seq.table), seq.adapter)
        input_ids = [t for s in seqs for t in s.tokens]
        return StepPlan(step_id, rows, input_ids, new=new, finished=finished)

    def _spread(self, table: list[int], group: int) -> list[int]:
        """On a cache of several KV groups (a hybrid model's), entry b of a table is block
        b x num_groups + g in group g: no two groups share a block."""
        return [block * self.num_groups + group for block in table]


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


_STEPS: weakref.WeakKeyDictionary[ModelRunner, Steps] = weakref.WeakKeyDictionary()


def steps_for(runner: ModelRunner) -> Steps:
    """The plans `runner` is sent here (tests, benches, the device check), which remember
    what it holds."""
    if runner not in _STEPS:
        _STEPS[runner] = Steps(runner.limits.num_groups)
    return _STEPS[runner]


def plan_of(seqs: list[Seq], step_id: int = 0, num_groups: int = 1) -> StepPlan:
    """The step of `seqs`, standing alone: every sequence introduced afresh."""
    return Steps(num_groups).plan(seqs, step_id, standalone=True)


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
    result = runner.execute(steps_for(runner).plan(seqs))
    if result.error is not None:
        raise RuntimeError(result.error)
    return [row[0] for row in result.tokens]  # one token per sampled sequence


def prefill(runner: ModelRunner, seq: Seq, chunk: int) -> torch.Tensor:
    """Feeds seq.tokens from seq.start in chunks of `chunk`; the last one's logits [vocab]."""
    for first in range(0, len(seq.tokens), chunk):
        part = seq.tokens[first : first + chunk]
        last = first + chunk >= len(seq.tokens)
        step = Seq(seq.seq_id, part, seq.start + first, seq.table, sample=last)
        logits = runner.step_logits(steps_for(runner).plan([step]))
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
