"""Disaggregated prefill and decode between two engines on a tiny model, their workers in
this process moving K/V through the in-process connector: the producer holds a prompt's
blocks until the consumer's notice (or the hold's deadline), the consumer's request waits
in a receiving state no step computes, then computes only the prompt's last token, and its
greedy output is the one an engine of its own computes. A failed pull ends the request
kv_transfer_failed; every block comes back on both sides. A prompt that fits the producer's
staging arena is handed over staged (read in one segment), one that does not from the cache,
and both decode alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import trio

from service.api.errors import APIError
from service.api.kv_transfer_params import kv_transfer_fields
from service.config import Config
from service.engine.assembly import open_engine
from service.engine.engine import Engine
from service.engine.kv_transfer import HOLD_MARGIN_S, KV_TRANSFER_FAILED
from service.engine.request import SamplingParams, SamplingSpec
from service.engine.validation import InvalidRequest
from tests.in_process_worker import InProcessWorker
from tests.sim_worker import SimTokenizer, collect, run_together

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 4  # tests.worker_fixtures.BLOCK_SIZE
KV_MEMORY = float(1024 * 1024)
PROMPTS = [[(13 * s + 7 * i) % 250 + 3 for i in range(5 + 6 * s)] for s in range(4)]
GENERATED = 8


def config(role: str | None, **overrides: object) -> Config:
    settings: dict = dict(
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        max_batched_tokens=8,  # the producer computes the longer prompts in chunks
        kv_memory=KV_MEMORY,
        use_cuda_graphs=False,
        kv_transfer_role=role,
        debug_invariants=True,
    )
    return Config(**{**settings, **overrides})


@asynccontextmanager
async def engines(
    model_dir: Path, *roles: str | None, **overrides: object
) -> AsyncIterator[tuple[list[Engine], list[InProcessWorker]]]:
    staging = config(None, **overrides).kv_staging_tokens
    workers = [InProcessWorker(model_dir, KV_MEMORY, staging) for _ in roles]
    async with AsyncExitStack() as stack:
        started = [
            await stack.enter_async_context(
                open_engine(config(role, **overrides), worker=worker, tokenizer=SimTokenizer())
            )
            for role, worker in zip(roles, workers, strict=True)
        ]
        yield started, workers


def greedy(max_tokens: int, **fields: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, sampling=SamplingSpec(), **fields)


def seeded(max_tokens: int, **fields: object) -> SamplingParams:
    spec = SamplingSpec(temperature=1.0, seed=7)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, sampling=spec, **fields)


async def prefill(producer: Engine, prompt: list[int], request_id: str) -> dict:
    """The producer's half: one token, and where it holds the prompt's K/V."""
    channel = await producer.submit(prompt, greedy(1, remote_decode=True), request_id=request_id)
    finish = (await collect(channel)).finish
    assert finish is not None and finish.kv_transfer_params is not None, finish
    return finish.kv_transfer_params


async def decode(consumer: Engine, prompt: list[int], params: dict, request_id: str, how=greedy):
    fields = kv_transfer_fields(params)  # as the API reads what the router copied
    channel = await consumer.submit(prompt, how(GENERATED, **fields), request_id=request_id)
    return await collect(channel)


async def wait_until(condition, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


async def test_handed_over_prompts_decode_as_one_engine_computes_them(tiny_models):
    model = tiny_models("llama")
    # an arena of 2 blocks: the first prompt (2 blocks) is staged, the longer ones are not
    roles = (None, "producer", "consumer")
    async with engines(model, *roles, kv_staging_tokens=2 * BLOCK) as (
        [alone, producer, consumer],
        w,
    ):
        reference = await run_together(alone, PROMPTS, greedy(GENERATED), "ref")
        outputs, staged = [], []
        for i, prompt in enumerate(PROMPTS):
            params = await prefill(producer, prompt, f"p{i}")
            assert params["remote_block_ids"] and params["prompt_tokens"] == len(prompt)
            staged.append(params["remote_staging_address"] is not None)
            outputs.append((await decode(consumer, prompt, params, f"d{i}")).token_ids)
        assert outputs == reference and staged == [True, False, False, False]
        # seeded sampling too: the consumer's first sample is the request's first
        sampled_alone = await run_together(alone, PROMPTS[:2], seeded(GENERATED), "seeded")
        for i, prompt in enumerate(PROMPTS[:2]):
            params = await prefill(producer, prompt, f"ps{i}")
            handed = await decode(consumer, prompt, params, f"ds{i}", seeded)
            assert handed.token_ids == sampled_alone[i]
        holds = producer.scheduler.kv_holds
        assert holds is not None
        await wait_until(lambda: holds.released == len(PROMPTS) + 2)
        assert holds.expired == 0 and not holds.by_id
        arena = producer.state()["kv_transfer"]["staging"]
        assert arena["used"] == 0 and arena["unstaged"] >= 3
        for engine in (producer, consumer):
            await wait_until(lambda e=engine: not e.scheduler.has_work())
            assert engine.scheduler.blocks.num_used == 0  # cached blocks are evictable
    # the consumer computed one token of each prompt, the last, and none before its pull
    # (one request at a time: the pulls and the sequences' first rows come in one order)
    handed = [*PROMPTS, *PROMPTS[:2]]
    pulls = [step for step, plan in enumerate(w[2].plans) for _ in plan.pulls]
    first_rows: dict[int, tuple[int, int, int]] = {}  # seq -> its first row's step, start, size
    for step, plan in enumerate(w[2].plans):
        for row in plan.rows:
            first_rows.setdefault(row.seq_id, (step, row.start_pos, row.num_tokens))
    handed_rows = [first_rows[seq] for seq in sorted(first_rows)][-len(handed) :]
    assert len(pulls) == len(handed)
    for prompt, pulled, (step, start, size) in zip(handed, pulls, handed_rows, strict=True):
        assert (start, size) == (len(prompt) - 1, 1) and step > pulled


async def test_a_hold_nobody_pulls_expires_and_frees_its_blocks(tiny_models):
    async with engines(tiny_models("llama"), "producer", kv_hold_timeout=0.3) as ([producer], _):
        params = await prefill(producer, PROMPTS[3], "p")
        holds = producer.scheduler.kv_holds
        assert holds is not None and holds.held == 1
        assert producer.scheduler.blocks.num_used == len(params["remote_block_ids"])
        assert producer.state()["kv_transfer"]["holds"]["holding"] == 1
        staging = producer.scheduler.kv_staging
        assert staging is not None and staging.used == len(params["remote_block_ids"])
        assert params["remote_staging_address"] is not None
        await wait_until(lambda: holds.expired == 1)
        assert producer.scheduler.blocks.num_used == 0 and holds.released == 0
        assert staging.used == 0


async def test_a_pull_that_would_start_too_near_the_holds_end_fails_unread(tiny_models):
    async with engines(tiny_models("llama"), "producer", "consumer") as (pair, w):
        producer, consumer = pair
        params = await prefill(producer, PROMPTS[2], "p")
        assert 0 < params["remote_hold_seconds"] <= config(None).kv_hold_timeout
        # as if the router took the hold's time: less than the margin is left
        late = {**params, "remote_hold_seconds": HOLD_MARGIN_S / 2}
        out = await decode(consumer, PROMPTS[2], late, "late")
        assert out.finish is not None and out.finish.detail == KV_TRANSFER_FAILED
        assert "hold ends before" in (out.finish.error or "")
        assert not any(plan.rows for plan in w[1].plans)
        holds = producer.scheduler.kv_holds
        assert holds is not None and holds.kept == 0  # never read
        out = await decode(consumer, PROMPTS[2], params, "d")  # in time: read, then released
        assert out.finish is not None and out.finish.reason == "length"
        await wait_until(lambda: holds.released == 1)
        assert holds.kept == 1  # its reading notice came first
        await wait_until(lambda: not consumer.scheduler.has_work())
        assert consumer.scheduler.blocks.num_used == 0


async def test_a_failed_pull_ends_the_request_and_frees_its_blocks(tiny_models):
    async with engines(tiny_models("llama"), "producer", "consumer") as ([producer, consumer], w):
        params = await prefill(producer, PROMPTS[2], "p")
        gone = {**params, "remote_host": "local", "remote_port": 999999}  # no such peer
        out = await decode(consumer, PROMPTS[2], gone, "d")
        assert out.finish is not None and out.finish.detail == KV_TRANSFER_FAILED
        assert out.token_ids == [] and "no peer" in (out.finish.error or "")
        assert not any(plan.rows for plan in w[1].plans)  # nothing recomputed the prompt
        await wait_until(lambda: not consumer.scheduler.has_work())
        assert consumer.scheduler.blocks.num_used == 0


async def test_a_mismatched_layout_or_role_is_refused_naming_what_differs(tiny_models):
    async with engines(tiny_models("llama"), "producer", "consumer") as ([producer, consumer], _):
        params = await prefill(producer, PROMPTS[1], "p")
        staging, hold = "remote_staging_address", "remote_hold_seconds"
        wrongs = ((staging, -1), (staging, "0x10"), (staging, True), (hold, -1), (hold, "2"))
        for name, wrong in wrongs:  # the API's 400, naming the field
            with pytest.raises(APIError, match=name) as refused:
                kv_transfer_fields({**params, name: wrong})
            assert (refused.value.status, refused.value.param) == (400, "kv_transfer_params")
        other = {**params, "fingerprint": {**params["fingerprint"], "block_size": 16}}
        with pytest.raises(InvalidRequest, match="block_size"):
            await decode(consumer, PROMPTS[1], other, "d1")
        with pytest.raises(InvalidRequest, match="prompt has"):
            await decode(consumer, PROMPTS[1][:-1], params, "d2")
        with pytest.raises(InvalidRequest, match="not a KV producer"):
            await consumer.submit(PROMPTS[0], greedy(1, remote_decode=True), request_id="x")
        with pytest.raises(InvalidRequest, match="not a KV consumer"):
            await decode(producer, PROMPTS[1], params, "d3")
        out = await decode(consumer, PROMPTS[1], params, "d4")  # the hold is still there
        assert out.finish is not None and out.finish.reason == "length"


def flat(block_ids: list) -> list[int]:
    """remote_block_ids as one list: a hybrid model's are a list per KV group."""
    return [b for ids in block_ids for b in ids] if isinstance(block_ids[0], list) else block_ids


WINDOW = 11  # the tiny Gemma 3's: its windowed groups hand over less of the longer prompts
LONG = [[(11 * s + 5 * i) % 250 + 3 for i in range(n)] for s, n in enumerate((13, 27, 30))]


def pulled(consumer: InProcessWorker, params: dict) -> int:
    """How many blocks `consumer` pulled for the handover of `params`."""
    pulls = (pull for plan in consumer.plans for pull in plan.pulls)
    return len(next(p for p in pulls if p.transfer_id == params["transfer_id"]).local_blocks)


async def all_blocks_back(producer: Engine, consumer: Engine, handovers: int) -> None:
    holds = producer.scheduler.kv_holds
    assert holds is not None
    await wait_until(lambda: holds.released == handovers)
    assert holds.expired == 0
    for engine in (producer, consumer):
        await wait_until(lambda e=engine: not e.scheduler.has_work())
        assert engine.scheduler.blocks.num_used == 0


KINDS = pytest.mark.parametrize(("kind", "groups"), [("llama", 1), ("gemma3", 3)])


@KINDS
async def test_kv_groups_hand_over_what_each_reads(tiny_models, kind, groups):
    """One KV group, and Gemma 3's (a full one, two windowed): the answers are one engine's;
    a windowed group hands over only its window's blocks; all come back."""
    async with engines(tiny_models(kind), None, "producer", "consumer") as ([alone, p, c], w):
        reference = await run_together(alone, LONG, greedy(GENERATED), "ref")
        for i, prompt in enumerate(LONG):
            params = await prefill(p, prompt, f"p{i}")
            ids = params["remote_block_ids"]
            entries = -(-len(prompt) // BLOCK)
            if groups == 1:
                assert len(ids) == entries
            else:  # the full group's every block, a windowed one's from the window of the
                # position a later prompt's hit computes from on
                first = max(0, (len(prompt) - 1) // BLOCK * BLOCK - WINDOW + 1) // BLOCK
                assert [len(g) for g in ids] == [entries] + [entries - first] * 2
            assert p.scheduler.blocks.num_used == len(flat(ids))  # the hold, nothing more
            assert (await decode(c, prompt, params, f"d{i}")).token_ids == reference[i]
            assert pulled(w[2], params) == len(flat(ids))  # nothing of it cached there yet
        await all_blocks_back(p, c, len(LONG))


@KINDS
async def test_both_prefix_caches_work_through_a_handover(tiny_models, kind, groups):
    """The producer's held blocks are prefix-cache hits for a later prompt, shared
    (refcount 2) until both holds end; the consumer's pulled blocks are hits there: a later
    handover of the prompt pulls only what they do not hold (each group's last block), a
    plain request computes only its last block."""
    prompt = LONG[-1]
    hit = (len(prompt) - 1) // BLOCK * BLOCK
    async with engines(tiny_models(kind), None, "producer", "consumer") as ([alone, p, c], w):
        [reference] = await run_together(alone, [prompt], greedy(GENERATED), "ref")
        assert (await decode(c, prompt, await prefill(p, prompt, "p"), "d")).token_ids == reference
        held = [await prefill(p, prompt, "again-1")]
        channel = await p.submit(prompt, greedy(1, remote_decode=True), request_id="again-2")
        second = (await collect(channel)).finish
        assert second is not None and second.kv_transfer_params is not None
        assert second.cached_tokens == hit
        held.append(second.kv_transfer_params)
        mine, theirs = (flat(params["remote_block_ids"]) for params in held)
        shared = set(mine) & set(theirs)
        assert len(shared) == len(mine) - groups  # all but each group's last block
        assert all(p.scheduler.blocks.refcount(b) == 2 for b in shared)
        hits = c.scheduler.stats().prefix_hits
        for j, params in enumerate(held):
            handed = await decode(c, prompt, params, f"again-d{j}")
            assert handed.token_ids == reference
            assert handed.finish is not None and handed.finish.cached_tokens == hit
            assert pulled(w[2], params) == groups
        assert c.scheduler.stats().prefix_hits == hits + 2 * hit  # in /metrics too
        plain = await collect(await c.submit(prompt, greedy(GENERATED), request_id="plain"))
        assert plain.finish is not None and plain.finish.cached_tokens == hit
        assert plain.token_ids == reference
        await all_blocks_back(p, c, 3)


async def test_remote_block_ids_are_checked_per_kv_group(tiny_models):
    """A hybrid model's remote_block_ids are a list per KV group, each as long as the
    handover of that prompt makes it: anything else is refused naming the group."""
    async with engines(tiny_models("gemma3"), "producer", "consumer") as ([p, c], _):
        prompt = LONG[-1]
        params = await prefill(p, prompt, "p")
        ids = params["remote_block_ids"]
        with pytest.raises(InvalidRequest, match="lists 1 KV groups' blocks, this model has 3"):
            await decode(c, prompt, {**params, "remote_block_ids": flat(ids)}, "d1")
        short = [ids[0], ids[1][:-1], ids[2]]
        with pytest.raises(InvalidRequest, match="of KV group 1 do not hold a 30-token prompt"):
            await decode(c, prompt, {**params, "remote_block_ids": short}, "d2")
        with pytest.raises(APIError, match="non-negative integers"):
            await decode(c, prompt, {**params, "remote_block_ids": [ids[0], [-1], ids[2]]}, "d3")
        out = await decode(c, prompt, params, "d4")  # the hold is still there
        assert out.finish is not None and out.finish.reason == "length"
        for engine in (p, c):
            await wait_until(lambda e=engine: not e.scheduler.has_work())
            assert engine.scheduler.blocks.num_used == 0
