"""A simulated worker for engine tests: same interface as WorkerLink, no model, no process.

Cost model: a step takes base_ms + per_token_ms * tokens + per_seq_ms * sequences
(+ per_pair_ms * attention pairs, for the cost of attention over long prefixes) from the
moment its plan arrives; with `memory_bound_tokens`, a step of fewer tokens costs as much
as one of that many, as on a CPU, where reading the weights bounds a small step and a few
rows more are nearly free (a decode with drafted tokens at low batch). The result is
ready then, whatever the engine does meanwhile, and receive_result sleeps until it is, so
a MockClock makes timing exact and instant. Like the real worker it reports, in
`idle_ms`, how long each plan kept it waiting after its previous result, and `events`
records, in order, when plans arrive and when the engine takes their results, so tests
can see it overlap its own work with a step.

Like the real worker it holds each sequence's block table from the plan that introduces
it to the plan that finishes it, and checks that every row's sequence was introduced and
that its blocks go where its table ends (or where the service gave entries back).

It keeps a fake KV cache (each slot remembers the token at its position and a digest of
every token up to it) and checks every plan against it: a chunk must continue where the
cache ends, block tables must cover the positions, a block a step writes is in no other
table of the step, and a sequence reading a position again finds the same digest as the
first time it wrote or read it (nobody overwrote a block under it). Cached prefixes are
shared: a sequence may start past position 0 and read what others wrote. The sampled token
is a function of the sequence's content read back from that cache, so outputs do not
depend on batch composition, on preemption or on the prefix cache, exactly the property
the real model must have under greedy sampling.

The "model" is that function, or with `period` a copying one: the token after position q
is the one at q + 1 - period, so a prompt's text comes back and n-gram drafts are right.
Drafted tokens (Row.drafts) are verified as the real worker does under greedy
sampling: the token after each position of the chunk's last k + 1 is computed, and the
drafts are kept up to the first that differs from it, so acceptance is predictable.

A plan's token bitmask (structured output) is honoured: a constrained sequence takes the
first allowed of EOS and the bytes that close JSON soonest, else the smallest allowed
byte that is not whitespace, so that every grammar it follows ends.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np
import trio

from gpu_worker.protocol import (
    DRAFT_MODEL_TOKEN,
    MAX_IDLE_GAP_S,
    Handshake,
    StepPlan,
    StepResult,
)
from policies.base import attention_pairs
from service.config import Config
from service.engine.assembly import open_engine
from service.engine.engine import Engine
from service.engine.request import Event, FinishEvent, SamplingParams, SamplingSpec, TokenEvent
from service.engine.stats import IterationStats, RequestEvent, RequestStats
from service.engine.worker_link import WorkerDeviceFault, WorkerDied, WorkerStartError

EOS = 256
# what a constrained sequence prefers: to end, then to close what is open
CLOSING_FIRST = (EOS, *b'"}]:0')
WHITESPACE = frozenset(b" \t\n\r")


class SimTokenizer:
    """Byte-level: ids 0..255 are bytes, 256 is the end-of-sequence special token."""

    vocab_size = 260
    bos_token_id = None
    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens and EOS in ids:
            text += "<eos>"
        return text


class KVMismatch(AssertionError):
    pass


@dataclass
class _InFlight:
    """The plan the simulated worker is computing."""

    step_id: int
    ready_at: float  # when its result is sent (or the worker dies)
    result: StepResult | None  # None: never answered (the worker dies or hangs on it)


@dataclass
class SimWorker:
    num_blocks: int = 512
    block_size: int = 16
    max_model_len: int = 8192
    max_batched_tokens: int = 8192
    base_ms: float = 5.0
    per_token_ms: float = 0.1
    per_seq_ms: float = 0.2
    per_pair_ms: float = 0.0
    memory_bound_tokens: int = 0  # a step of fewer tokens costs as much as one of this many
    draft_model_share: float = 0.1  # what its draft model costs, as a share of its own cost
    period: int | None = None  # the model copies its sequence from this many tokens back
    device: str = "cpu"  # as reported in the handshake
    device_warning: str | None = None  # likewise
    # (seq_id, position of the token to sample) -> sample EOS there
    eos_at: Callable[[int, int], bool] | None = None
    die_at_step: int | None = None  # the worker dies computing the n-th plan (1-based)
    # the n-th plan hits a device error: the worker reports "fatal" (device_error) and exits
    fault_at_step: int | None = None
    hang_at_step: int | None = None  # the n-th plan's result never comes (a hung worker)
    failing_starts: int = 0  # this many start() calls after the first fail
    hang_at_start: int | None = None  # the n-th start() call never returns
    blocks_after_restart: int | None = None  # a restarted worker's (different) KV size
    hung: bool = False  # pings and steps never answer, like a SIGSTOPped process
    on_plan: Callable[[StepPlan], None] | None = None  # called as each plan arrives
    honour_bitmasks: bool = True  # False: sample as if no token bitmask came
    kills: int = 0
    plans: list[StepPlan] = field(default_factory=list)  # as they arrived
    # ("plan", step_id) when a plan arrives, ("result", step_id) when the engine takes its
    # result; tests may add their own entries to see what the engine did in between
    events: list[tuple[str, int]] = field(default_factory=list)
    starts: int = 0
    stopped: bool = False
    tables: dict[int, list[int]] = field(default_factory=dict)  # what it holds, by seq_id
    _kv: dict[int, list[tuple[int, int, int] | None]] = field(default_factory=dict)
    _digests: dict[int, dict[int, int]] = field(default_factory=dict)  # seq -> pos -> digest
    _calls: int = 0
    _start_calls: int = 0
    _gone: trio.Event = field(default_factory=trio.Event)
    _in_flight: _InFlight | None = None
    _answered_at: float | None = None  # when the last result was sent

    async def start(self) -> Handshake:
        await trio.sleep(0.1)
        self._start_calls += 1
        if 1 < self._start_calls <= 1 + self.failing_starts:
            raise WorkerStartError("simulated: the worker cannot start")
        if self._start_calls == self.hang_at_start:
            await trio.sleep_forever()
        if self.starts and self.blocks_after_restart is not None:
            self.num_blocks = self.blocks_after_restart
        self.starts += 1
        self.hung = False
        self._gone = trio.Event()
        self.tables.clear()
        self._kv.clear()
        self._digests.clear()
        self._in_flight = None
        self._answered_at = None
        return Handshake(
            model_name="sim",
            architecture="SimForCausalLM",
            vocab_size=SimTokenizer.vocab_size,
            max_model_len=self.max_model_len,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            dtype="float32",
            device=self.device,
            device_warning=self.device_warning,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_bytes=0,
            kv_cache_dtype="bfloat16",
            decode_buckets=[1, 2, 4, 8],
            pid=0,
            load_seconds=0.1,
        )

    async def stop(self) -> None:
        self.stopped = True

    async def ping(self) -> None:
        assert self._in_flight is None, "a ping while a plan is in flight"
        self._answered_at = None  # as the real worker: the service was idle
        if self.hung:
            await trio.sleep_forever()
        await trio.sleep(0.001)

    async def wait_closed(self) -> None:
        await self._gone.wait()

    async def kill(self) -> None:
        self.kills += 1
        self._gone.set()

    def exit_while_idle(self) -> None:
        """As if the process died on its own between steps."""
        self._gone.set()

    def cost_ms(self, plan: StepPlan) -> float:
        return (
            self.base_ms
            + self.per_token_ms * max(plan.total_tokens, self.memory_bound_tokens)
            + self.per_seq_ms * len(plan.seq_ids)
            + self.per_pair_ms * sum(map(attention_pairs, plan.start_pos, plan.num_tokens))
            + self._draft_model_ms(plan)
        )

    def _draft_model_ms(self, plan: StepPlan) -> float:
        """A draft model's passes (one per draft of the longest row's) and context tokens:
        a model `draft_model_share` as costly as this one, each pass a step of its rows."""
        passes = max((row.drafts.count(DRAFT_MODEL_TOKEN) for row in plan.rows), default=0)
        context = sum(len(row.draft_context) for row in plan.rows)
        if not passes and not context:
            return 0.0
        step = self.base_ms + self.per_token_ms * self.memory_bound_tokens
        context_ms = self.per_token_ms * max(context - self.memory_bound_tokens, 0)
        return self.draft_model_share * (max(passes, 1) * step + context_ms)

    def _drafted_by_model(self, plan: StepPlan) -> StepPlan:
        """`plan` with its DRAFT_MODEL_TOKEN drafts chosen by a draft model that is always
        right (the model itself), as the real worker fills them (gpu_worker.draft_model)."""
        if not any(DRAFT_MODEL_TOKEN in row.drafts for row in plan.rows):
            return plan
        input_ids, rows, offset = list(plan.input_ids), [], 0
        for row in plan.rows:
            n, start, draft, table = (
                row.num_tokens,
                row.start_pos,
                row.drafts,
                self.tables[row.seq_id],
            )
            for k in range(n - len(draft)):
                self._write(table, row.seq_id, start + k, input_ids[offset + k])
            chosen = []
            for k in range(n - len(draft), n):
                token = self._next_token(table, row.seq_id, start + k - 1)
                self._write(table, row.seq_id, start + k, token)
                chosen.append(token)
            input_ids[offset + n - len(draft) : offset + n] = chosen
            rows.append(dataclasses.replace(row, drafts=chosen))
            offset += n
        return dataclasses.replace(plan, input_ids=input_ids, rows=rows)

    async def send_step(self, plan: StepPlan) -> None:
        await trio.lowlevel.checkpoint()  # a real send is one: aborts and arrivals land here
        assert self._in_flight is None, "a plan sent before the previous result was taken"
        now = trio.current_time()
        self._calls += 1
        self.plans.append(plan)
        self.events.append(("plan", plan.step_id))
        if self.on_plan is not None:
            self.on_plan(plan)
        if self._calls == self.hang_at_step:
            self.hung = True
        if self.hung or self._calls in (self.die_at_step, self.fault_at_step):
            self._in_flight = _InFlight(plan.step_id, now + 0.001, None)  # never answered
            return
        self.check_plan(plan)
        result = self._compute(plan)
        result.idle_ms = self._idle_ms(now)
        self._in_flight = _InFlight(plan.step_id, now + result.step_ms / 1000, result)

    async def receive_result(self, step_id: int) -> StepResult:
        flight = self._in_flight
        assert flight is not None and flight.step_id == step_id, "no such plan in flight"
        if self.hung:
            await trio.sleep_forever()
        await trio.sleep_until(flight.ready_at)
        if flight.result is None and self._calls == self.fault_at_step:
            raise WorkerDeviceFault("simulated: CUDA error: an illegal memory access")
        if flight.result is None:
            raise WorkerDied("simulated crash")
        self._in_flight = None
        self._answered_at = flight.ready_at
        self.events.append(("result", step_id))
        return flight.result

    def _idle_ms(self, now: float) -> float | None:
        if self._answered_at is None or now - self._answered_at > MAX_IDLE_GAP_S:
            return None
        return (now - self._answered_at) * 1000

    def _compute(self, plan: StepPlan) -> StepResult:
        result = StepResult(step_id=plan.step_id, step_ms=self.cost_ms(plan))
        plan = self._drafted_by_model(plan)
        offset = 0
        for row in plan.rows:
            n, start, table, seq_id = (
                row.num_tokens,
                row.start_pos,
                self.tables[row.seq_id],
                row.seq_id,
            )
            for k in range(n):
                self._write(table, seq_id, start + k, plan.input_ids[offset + k])
            offset += n
            if row.sample:
                drafts = row.drafts
                tokens = self._verify(table, seq_id, start + n - 1 - len(drafts), drafts)
                if row.bitmask is not None and self.honour_bitmasks:
                    assert not drafts, "a constrained sequence drafted"
                    tokens = [constrained_choice(row.bitmask)]
                result.seq_ids.append(seq_id)
                result.tokens.append(tokens)
        return result

    def _verify(self, table: list[int], seq_id: int, last: int, drafts: list[int]) -> list[int]:
        """The drafts up to the first the model does not sample, then the token it samples
        there (after all of them, when all are right)."""
        taken: list[int] = []
        for draft in [*drafts, None]:  # None: after the last draft, whatever is sampled
            taken.append(self._next_token(table, seq_id, last + len(taken)))
            if taken[-1] != draft:
                break
        return taken

    def check_plan(self, plan: StepPlan) -> None:
        """The plan against what this worker holds, which it then applies."""
        self._apply(plan)
        seq_ids = plan.seq_ids
        assert len(set(seq_ids)) == len(seq_ids), "a sequence appears twice in one step"
        assert sum(plan.num_tokens) == len(plan.input_ids), "input ids do not match num_tokens"
        assert plan.total_tokens <= self.max_batched_tokens, "step larger than the worker allows"
        tables = [self.tables[seq_id] for seq_id in seq_ids]
        written: set[int] = set()
        for row, table in zip(plan.rows, tables, strict=True):
            end = row.start_pos + row.num_tokens
            assert row.num_tokens >= 1
            assert end <= len(table) * self.block_size, "block table too short for positions"
            assert end <= self.max_model_len
            assert len(set(table)) == len(table), "a block twice in one table"
            for block in table:
                assert 0 <= block < self.num_blocks, f"block {block} out of range"
            for block in table[row.start_pos // self.block_size :]:
                assert block not in written, f"block {block} written by two sequences"
                written.add(block)
        for row, table in zip(plan.rows, tables, strict=True):
            read = table[: row.start_pos // self.block_size]
            assert not written & set(read), "a step writes a block another sequence reads"

    def _apply(self, plan: StepPlan) -> None:
        """`finished`, then `new`, then each row's blocks, as gpu_worker.seq_table does."""
        for seq_id in plan.finished:
            self.tables.pop(seq_id, None)
        for new in plan.new:
            assert new.seq_id not in self.tables, f"sequence {new.seq_id} introduced twice"
            self.tables[new.seq_id] = []
        for row in plan.rows:
            assert row.seq_id in self.tables, f"sequence {row.seq_id} was never introduced"
            table = self.tables[row.seq_id]
            at = len(table) if row.blocks_at is None else row.blocks_at
            assert at <= len(table), f"sequence {row.seq_id}'s blocks leave a gap in its table"
            del table[at:]
            if row.blocks:
                assert len(row.blocks) == 1, "the simulated cache has one KV group"
                table += row.blocks[0]

    def _write(self, table: list[int], seq_id: int, pos: int, token: int) -> None:
        # a chunk must continue the cached prefix
        parent = self._slot(table, seq_id, pos - 1)[2] if pos > 0 else 0
        digest = (parent * 1000003 + token + 1) % 1_000_000_007
        block = table[pos // self.block_size]
        slots = self._kv.setdefault(block, [None] * self.block_size)
        slots[pos % self.block_size] = (pos, token, digest)
        self._digests.setdefault(seq_id, {})[pos] = digest

    def _slot(self, table: list[int], seq_id: int, pos: int) -> tuple[int, int, int]:
        slots = self._kv.get(table[pos // self.block_size])
        entry = None if slots is None else slots[pos % self.block_size]
        if entry is None or entry[0] != pos:
            raise KVMismatch(f"seq {seq_id} position {pos}: cache holds {entry}")
        known = self._digests.setdefault(seq_id, {}).setdefault(pos, entry[2])
        if known != entry[2]:
            raise KVMismatch(f"seq {seq_id} position {pos}: overwritten since it was read")
        return entry

    def _read(self, table: list[int], seq_id: int, pos: int) -> int:
        return self._slot(table, seq_id, pos)[1]

    def _next_token(self, table: list[int], seq_id: int, last: int) -> int:
        if self.eos_at is not None and self.eos_at(seq_id, last + 1):
            return EOS
        if self.period is not None and last + 1 >= self.period:
            return self._read(table, seq_id, last + 1 - self.period)
        # attention "sees" the whole prefix: sample a few positions of it
        h = 17 * last
        for pos in {0, last // 3, last // 2, last - 1, last}:
            if pos >= 0:
                h = (h * 1000003 + self._read(table, seq_id, pos)) % 1_000_000_007
        return 97 + h % 26  # a..z


def constrained_choice(bitmask: str) -> int:
    """The token a constrained sequence takes (module docstring)."""
    words = np.frombuffer(base64.b64decode(bitmask), dtype=np.uint8)
    allowed = np.flatnonzero(np.unpackbits(words, bitorder="little")[: SimTokenizer.vocab_size])
    assert allowed.size, "a bitmask that allows no token"
    preferred = [t for t in CLOSING_FIRST if t in allowed]
    solid = [t for t in allowed.tolist() if t not in WHITESPACE]
    return (preferred or solid or allowed.tolist())[0]


def sim_tokenizer_info() -> object:
    """xgrammar's view of SimTokenizer: one token per byte, then EOS and empty ids."""
    import xgrammar

    vocab = [bytes([i]) for i in range(256)] + [b""] * (SimTokenizer.vocab_size - 256)
    return xgrammar.TokenizerInfo(vocab, vocab_size=SimTokenizer.vocab_size, stop_token_ids=[EOS])


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, sampling=SamplingSpec(temperature=0.0), **kw)


def expected_tokens(prompt: list[int], count: int, period: int | None = None) -> list[int]:
    """What SimWorker (of that `period`) generates for `prompt`, computed without the engine."""
    tokens = list(prompt)
    for _ in range(count):
        last = len(tokens) - 1
        if period is not None and last + 1 >= period:
            tokens.append(tokens[last + 1 - period])
            continue
        h = 17 * last
        for pos in {0, last // 3, last // 2, last - 1, last}:
            if pos >= 0:
                h = (h * 1000003 + tokens[pos]) % 1_000_000_007
        tokens.append(97 + h % 26)
    return tokens[len(prompt) :]


def sim_config(**overrides: object) -> Config:
    # overlap "on": the engine suites run the overlapped loop ("auto" would be off: "cpu")
    base = {
        "max_batched_tokens": 512,
        "max_num_seqs": 64,
        "debug_invariants": True,
        "overlap": "on",
    }
    base.update(overrides)
    return Config(**base)  # type: ignore[arg-type]


@asynccontextmanager
async def running_engine(
    config: Config | None = None, worker: SimWorker | None = None
) -> AsyncIterator[Engine]:
    async with open_engine(
        config or sim_config(), worker=worker or SimWorker(), tokenizer=SimTokenizer()
    ) as engine:
        yield engine


@dataclass
class RecordingObserver:
    """Keeps everything the engine reports, for assertions."""

    received: list[str] = field(default_factory=list)
    iterations: list[IterationStats] = field(default_factory=list)
    finished: list[RequestStats] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swaps: list[tuple[str, str, int]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    events: list[RequestEvent] = field(default_factory=list)

    def on_request_received(self, request_id: str, tenant: str, prompt_tokens: int) -> None:
        self.received.append(request_id)

    def on_iteration(self, stats: IterationStats) -> None:
        self.iterations.append(stats)

    def on_request_finished(self, stats: RequestStats) -> None:
        self.finished.append(stats)

    def on_preemption(self, request_id: str) -> None:
        self.preempted.append(request_id)

    def on_policy_swap(self, old: str, new: str, iteration: int) -> None:
        self.swaps.append((old, new, iteration))

    def on_request_refused(self, reason: str) -> None:
        self.refused.append(reason)

    def on_request_event(self, event: RequestEvent) -> None:
        self.events.append(event)


@dataclass
class Collected:
    tokens: list[TokenEvent] = field(default_factory=list)
    finish: FinishEvent | None = None
    times: list[float] = field(default_factory=list)  # when each TokenEvent was received

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.tokens for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.tokens)


async def collect(channel: trio.MemoryReceiveChannel, into: Collected | None = None) -> Collected:
    """Read a request's stream to its end, checking its shape on the way."""
    out = into if into is not None else Collected()
    async for event in channel:
        event: Event
        assert out.finish is None, "an event after the FinishEvent"
        if isinstance(event, FinishEvent):
            out.finish = event
        else:
            out.tokens.append(event)
            out.times.append(trio.current_time())
    assert out.finish is not None, "stream closed without a FinishEvent"
    return out


async def run_together(
    engine: Engine, token_lists: list[list[int]], params: SamplingParams, tag: str
) -> list[list[int]]:
    """Submit every prompt at once (request ids `tag`-i); each one's tokens, in order."""
    results: list[list[int]] = [[] for _ in token_lists]

    async def one(i: int, ids: list[int]) -> None:
        channel = await engine.submit(ids, params, request_id=f"{tag}-{i}")
        results[i] = (await collect(channel)).token_ids

    async with trio.open_nursery() as nursery:
        for i, ids in enumerate(token_lists):
            nursery.start_soon(one, i, ids)
    return results
