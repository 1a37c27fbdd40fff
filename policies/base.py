"""What a scheduling policy sees and what it returns.

A policy is pure decision code: it gets a read-only View of one iteration and returns a
Decision. It imports nothing from the service; the engine's core validates every
decision (token budget, sequence cap, free KV blocks), so a wrong policy cannot break it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar


class PolicyError(ValueError):
    """An unknown policy name or invalid parameters; nothing was changed."""


@dataclass(frozen=True, slots=True)
class SeqView:
    seq_id: int
    tenant: str
    priority: int  # as vLLM: lower runs first under the `priority` policy (default 0)
    arrival: float  # seconds, engine clock
    prompt_len: int
    num_generated: int
    # tokens whose K/V is in the cache; for a waiting sequence, the prefix it would find
    # in the prefix cache (admission starts it there)
    num_computed_tokens: int
    # KV blocks held now; for a waiting sequence, the cached blocks it would share at no
    # cost (others hold them), so that View.blocks_for is what admitting it takes
    num_blocks: int
    preempted: int = 0  # how many times it was preempted
    waiting: bool = False  # not admitted (View.waiting): the two fields above are its hit's
    deadline: float | None = None  # engine clock: it must start by then, or it is refused
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache, not computed
    adapter: str | None = None  # its LoRA adapter (None: the base model)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def remaining(self) -> int:
        """Tokens to compute before this sequence can sample its next token (>= 1)."""
        return max(1, self.num_tokens - self.num_computed_tokens)

    @property
    def is_decoding(self) -> bool:
        return self.num_tokens - self.num_computed_tokens <= 1


def by_deadline(seq: SeqView) -> tuple[bool, float, float]:
    """Sort key: earliest deadline first, then those without one, each by arrival."""
    return (seq.deadline is None, seq.deadline or 0.0, seq.arrival)


def attention_pairs(start: int, tokens: int) -> int:
    """(query, key) pairs of a chunk of `tokens` at position `start`: each query attends
    to the `start` cached keys and, causally, to its chunk up to itself."""
    return tokens * start + tokens * (tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepCost:
    """The engine's model of a step's worker time, fitted to the steps it measured:
    base_ms + ms_per_token * tokens + ms_per_pair * a chunk's attention pairs
    + ms_per_context * the cached tokens each decode reads."""

    base_ms: float
    ms_per_token: float
    ms_per_pair: float
    ms_per_context: float = 0.0

    def chunk_ms(self, start: int, tokens: int) -> float:
        """What a chunk adds to a step: its tokens and its attention at its position."""
        return self.ms_per_token * tokens + self.ms_per_pair * attention_pairs(start, tokens)

    def step_ms(self, tokens: int, pairs: int, context: int) -> float:
        """A whole step: `tokens`, `pairs` of prefill attention, `context` keys decodes read."""
        return (
            self.base_ms
            + self.ms_per_token * tokens
            + self.ms_per_pair * pairs
            + self.ms_per_context * context
        )

    def decode_ms(self, contexts: list[int]) -> float:
        """A step of decodes alone, base included: one per cached-token count in `contexts`."""
        return (
            self.base_ms + self.ms_per_token * len(contexts) + self.ms_per_context * sum(contexts)
        )

    def largest_chunk(self, start: int, max_ms: float, limit: int) -> int:
        """The most tokens (<= limit) a chunk at `start` may have to add at most `max_ms`;
        at least 1, so that a prompt always progresses."""
        a = self.ms_per_pair / 2
        b = self.ms_per_token + self.ms_per_pair * (start + 0.5)
        if b <= 0:
            return limit  # free (a zero-cost fit): only the limit bounds it
        if max_ms <= 0:
            return 1
        # the root of a*n^2 + b*n = max_ms, in the form that stays exact for tiny a
        tokens = int(min(limit, 2 * max_ms / (b + math.sqrt(b * b + 4 * a * max_ms))))
        while tokens < limit and self.chunk_ms(start, tokens + 1) <= max_ms:
            tokens += 1  # rounding left one out
        while tokens > 1 and self.chunk_ms(start, tokens) > max_ms:
            tokens -= 1
        return max(1, min(limit, tokens))


@dataclass(frozen=True, slots=True)
class View:
    iteration: int
    now: float
    running: tuple[SeqView, ...]  # admitted sequences, in admission order
    # the first of the sequences not admitted (new or preempted), in arrival order: a
    # bounded window, so a long queue costs a policy nothing
    waiting: tuple[SeqView, ...]
    num_waiting: int  # all of them, the window and beyond
    free_blocks: int
    total_blocks: int
    block_size: int
    max_batched_tokens: int  # the engine's hard cap for one step
    max_seqs: int
    last_step_ms: float | None  # worker time of the previous step, if any
    last_step_tokens: int  # tokens computed in the previous step
    step_cost: StepCost | None = None  # None until the engine has measured enough steps
    # blocks a newcomer's whole prompt may take: free, not promised to running prefills,
    # above the watermark, and 0 while admission pauses after a preemption (None: as free)
    admit_blocks: int | None = None
    # Each KV group's most blocks a sequence holds at once: None for a full group (all of
    # them), a windowed group's cap (its window's and a chunk's). Most models have one full
    # group; Gemma 3 a full one and five windowed (service.engine.block_manager).
    kv_caps: tuple[int | None, ...] = (None,)

    @property
    def admittable_blocks(self) -> int:
        return self.free_blocks if self.admit_blocks is None else self.admit_blocks

    def blocks_for(self, seq: SeqView, new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `new_tokens` more tokens: a running one, a block
        in each group per new table entry; a waiting one, what admitting it takes (its peak,
        a windowed group's up to the cap, less the hit's blocks others hold)."""
        entries = -(-(seq.num_computed_tokens + new_tokens) // self.block_size)
        if seq.waiting:
            peak = sum(entries if cap is None else min(entries, cap) for cap in self.kv_caps)
            return max(0, peak - seq.num_blocks)
        held = -(-seq.num_computed_tokens // self.block_size)  # its tables' entries
        return len(self.kv_caps) * max(0, entries - held)


class AdapterBound:
    """At most `limit` LoRA adapters in a step (0: no bound): a policy's
    max_adapters_per_step. Each step's rows of adapters beyond it wait (the engine also
    admits no sequence whose adapter finds every slot busy)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: set[str] = set()

    def admits(self, seq: SeqView) -> bool:
        """Whether `seq` may join the step; its adapter is then one the step holds."""
        if not self.limit or seq.adapter is None or seq.adapter in self.held:
            return True
        if len(self.held) >= self.limit:
            return False
        self.held.add(seq.adapter)
        return True


@dataclass(slots=True)
class Decision:
    # (seq_id, tokens to compute this step) in the order the policy prefers; a waiting
    # sequence listed here is admitted. A running sequence not listed waits this step.
    schedule: list[tuple[int, int]] = field(default_factory=list)
    # running sequences to preempt (their blocks are freed; recomputed later)
    preempt: list[int] = field(default_factory=list)
    # the most tokens the policy wants in the step, drafted ones included (speculative
    # decoding takes only what the schedule leaves of it); None: the engine's cap
    token_budget: int | None = None


class Policy:
    """Base class: subclasses set `name`, `Params` (a dataclass) and `decide`."""

    name: ClassVar[str]
    summary: ClassVar[str]

    @dataclass(frozen=True, slots=True)
    class Params:
        pass

    def __init__(self, params: Any) -> None:
        self.params = params

    @classmethod
    def from_params(cls, raw: dict[str, Any] | None) -> Policy:
        return cls(parse_params(cls.Params, raw or {}))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "params": dataclasses.asdict(self.params)}

    def decide(self, view: View) -> Decision:
        raise NotImplementedError


def parse_params(params_cls: type, raw: dict[str, Any]) -> Any:
    """Build a params dataclass from untrusted input: unknown keys and wrong types are errors.

    Each field may declare metadata {"min": x, "max": y} for range checks, and a
    dataclass may define `validate(self)` for checks across fields (raise PolicyError).
    """
    if not isinstance(raw, dict):
        raise PolicyError("params must be an object")
    known = {f.name: f for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise PolicyError(f"unknown parameter(s) {unknown}; expected some of {sorted(known)}")
    values = {}
    for name, value in raw.items():
        values[name] = _coerce(name, value, known[name])
    try:
        params = params_cls(**values)
    except TypeError as exc:
        raise PolicyError(str(exc)) from None
    check = getattr(params, "validate", None)
    if check is not None:
        check()
    return params


def _coerce(name: str, value: Any, spec: dataclasses.Field) -> Any:
    kind = spec.type if isinstance(spec.type, str) else getattr(spec.type, "__name__", "")
    if kind == "int":
        value = _as_int(name, value)
    elif kind == "float":
        if isinstance(value, bool):
            raise PolicyError(f"{name} must be a number, got {value!r}")
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise PolicyError(f"{name} must be a number, got {value!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise PolicyError(f"{name} must be finite")
    elif kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            value = value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise PolicyError(f"{name} must be true or false, got {value!r}")
    elif kind.startswith("dict") and not isinstance(value, dict):
        raise PolicyError(f"{name} must be an object")
    low, high = spec.metadata.get("min"), spec.metadata.get("max")
    if low is not None and value < low:
        raise PolicyError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise PolicyError(f"{name} must be <= {high}, got {value}")
    return value


def _as_int(name: str, value: Any) -> int:
    """An int, or a string of one (as a command line gives it); anything else is an error."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:  # "--5", "²", a 5,000-digit string
            pass
    raise PolicyError(f"{name} must be an integer, got {value!r:.40}")
