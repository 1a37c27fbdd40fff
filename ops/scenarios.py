"""Workloads: which requests to send, when, with what prompt and output lengths.

Every builder is a pure function of its parameters and a seeded `random.Random`, so the
same seed gives the same workload against every server (what `bench compare` relies on).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ops.client import RequestSpec
from ops.prompts import PromptMaker

SCENARIOS = ("throughput", "poisson", "interference", "tenants")
CONTEXT_WINDOW = 8192  # the default model's; prompt + output must fit in it


@dataclass(frozen=True, slots=True)
class LengthRange:
    """A token length, fixed (lo == hi) or drawn uniformly from [lo, hi]."""

    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A long-tailed token length: log-normal around `median`, clipped to `clip`."""

    median: int
    sigma: float
    clip: LengthRange

    def __post_init__(self) -> None:
        if self.sigma < 0 or not self.clip.lo <= self.median <= self.clip.hi:
            raise ValueError(
                f"log-normal length needs sigma >= 0 and {self.clip.lo} <= median <= "
                f"{self.clip.hi}, got median {self.median}, sigma {self.sigma:g}"
            )

    def draw(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.clip.hi, max(self.clip.lo, value))


@dataclass(frozen=True, slots=True)
class MixedShape:
    """What the `mixed` workload's requests look like, whatever their rate."""

    prompt: LogNormal
    output: LogNormal
    doc_share: float  # share of requests that carry a long document instead of a chat turn
    doc: LengthRange
    context_window: int = CONTEXT_WINDOW

    def __post_init__(self) -> None:
        if not 0 <= self.doc_share <= 1:
            raise ValueError(f"document share {self.doc_share:g} is outside 0..1")
        longest = max(self.prompt.clip.hi, self.doc.hi if self.doc_share else 0)
        if longest + self.output.clip.hi > self.context_window:
            raise ValueError(
                f"a {longest}-token prompt plus {self.output.clip.hi} output tokens does not "
                f"fit the {self.context_window}-token context window"
            )


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    arrival_s: float
    prompt_len: int
    max_tokens: int
    role: str


@dataclass(frozen=True, slots=True)
class Injection:
    prompt_len: int
    at_s: float


def parse_length_range(text: str) -> LengthRange:
    """`128` or `64:256`."""
    lo_text, _, hi_text = text.partition(":")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if hi_text else lo
    except ValueError:
        raise ValueError(f"length {text!r} is not N or LO:HI") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"length {text!r} must satisfy 1 <= LO <= HI")
    return LengthRange(lo, hi)


def parse_injections(text: str) -> list[Injection]:
    """`256@2,1024@6,4096@10`: prompt lengths in tokens at times in seconds."""
    injections = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        length_text, at, time_text = item.partition("@")
        try:
            injection = Injection(int(length_text), float(time_text))
        except ValueError:
            raise ValueError(f"injection {item!r} is not LENGTH@SECONDS") from None
        if not at or injection.prompt_len < 1 or injection.at_s < 0:
            raise ValueError(f"injection {item!r} needs LENGTH >= 1 and SECONDS >= 0")
        injections.append(injection)
    if not injections:
        raise ValueError("no injections given")
    return sorted(injections, key=lambda inj: inj.at_s)


class _SpecFactory:
    """Numbers requests and gives each a prompt from its own corpus offset."""

    def __init__(self, maker: PromptMaker, rng: random.Random, count: int) -> None:
        self._maker = maker
        self._offsets = maker.distinct_offsets(rng, count)
        self.specs: list[RequestSpec] = []

    def add(self, arrival_s: float, prompt_len: int, max_tokens: int, **extra) -> None:
        index = len(self.specs)
        prompt = self._maker.make(prompt_len, self._offsets[index])
        self.specs.append(RequestSpec(index, arrival_s, prompt, prompt_len, max_tokens, **extra))


def poisson_arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be > 0")
    arrivals, t = [], rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


def throughput(
    maker: PromptMaker,
    rng: random.Random,
    *,
    requests: int,
    prompt: LengthRange,
    output: LengthRange,
) -> list[RequestSpec]:
    """All requests at once."""
    factory = _SpecFactory(maker, rng, requests)
    for _ in range(requests):
        factory.add(0.0, prompt.draw(rng), output.draw(rng))
    return factory.specs


def spread_over_adapters(specs: list[RequestSpec], adapters: str) -> list[RequestSpec]:
    """Request i names adapter i mod their number (`a,b,c`); none: the run's model."""
    names = [name.strip() for name in adapters.split(",") if name.strip()]
    for spec in specs if names else []:
        spec.model = names[spec.index % len(names)]
    return specs


def poisson(
    maker: PromptMaker,
    rng: random.Random,
    *,
    rate: float,
    duration_s: float,
    prompt: LengthRange,
    output: LengthRange,
) -> list[RequestSpec]:
    """Arrivals of a Poisson process of `rate` requests/s during `duration_s`."""
    arrivals = poisson_arrivals(rng, rate, duration_s)
    factory = _SpecFactory(maker, rng, len(arrivals))
    for at in arrivals:
        factory.add(at, prompt.draw(rng), output.draw(rng))
    return factory.specs


def interference(
    maker: PromptMaker,
    rng: random.Random,
    *,
    decoders: int,
    decoder_prompt_len: int,
    decoder_tokens: int,
    injections: list[Injection],
    injected_tokens: int,
) -> list[RequestSpec]:
    """`decoders` long generations from t=0; prompts of growing length injected meanwhile."""
    factory = _SpecFactory(maker, rng, decoders + len(injections))
    for _ in range(decoders):
        factory.add(0.0, decoder_prompt_len, decoder_tokens, role="decoder")
    for injection in injections:
        factory.add(injection.at_s, injection.prompt_len, injected_tokens, role="injected")
    return factory.specs


def tenants(
    maker: PromptMaker,
    rng: random.Random,
    *,
    heavy_requests: int,
    heavy_prompt: LengthRange,
    heavy_output: LengthRange,
    light_rate: float,
    duration_s: float,
    light_prompt: LengthRange,
    light_output: LengthRange,
) -> list[RequestSpec]:
    """A heavy tenant floods the server at t=0; a light one trickles in as a Poisson process."""
    light_arrivals = poisson_arrivals(rng, light_rate, duration_s)
    factory = _SpecFactory(maker, rng, heavy_requests + len(light_arrivals))
    for _ in range(heavy_requests):
        factory.add(
            0.0, heavy_prompt.draw(rng), heavy_output.draw(rng), role="heavy", tenant="heavy"
        )
    for at in light_arrivals:
        factory.add(
            at, light_prompt.draw(rng), light_output.draw(rng), role="light", tenant="light"
        )
    return factory.specs


def mixed_plan(
    rng: random.Random, rate: float, duration_s: float, shape: MixedShape
) -> list[PlannedRequest]:
    """Poisson arrivals of chat turns and documents, lengths only (no prompt text).

    Lengths come from their own generator, seeded first, so request k has the same lengths
    at every rate and only its arrival scales: the rates of a sweep differ by load alone.
    """
    lengths_rng = random.Random(rng.getrandbits(64))
    plan = []
    for at in poisson_arrivals(rng, rate, duration_s):
        is_doc = lengths_rng.random() < shape.doc_share
        prompt_len = shape.doc.draw(lengths_rng) if is_doc else shape.prompt.draw(lengths_rng)
        max_tokens = shape.output.draw(lengths_rng)
        plan.append(PlannedRequest(at, prompt_len, max_tokens, "document" if is_doc else "chat"))
    return plan


def mixed(
    maker: PromptMaker, rng: random.Random, *, rate: float, duration_s: float, shape: MixedShape
) -> list[RequestSpec]:
    """Chat turns with long-tailed lengths and a share of long documents, Poisson arrivals."""
    plan = mixed_plan(rng, rate, duration_s, shape)
    factory = _SpecFactory(maker, rng, len(plan))
    for planned in plan:
        factory.add(planned.arrival_s, planned.prompt_len, planned.max_tokens, role=planned.role)
    return factory.specs
