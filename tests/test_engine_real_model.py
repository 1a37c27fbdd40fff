"""The engine on the real default model (CPU, in float32 and in bfloat16, the default dtype):
greedy outputs do not depend on batch company, prefill chunk size, or a preemption and
recompute. In bfloat16 on CPUs with AVX512-BF16 this runs the C++ prefill kernel. The
preemption's holds for a worker of its own and for a tensor-parallel group of three ranks
(the model's 3 KV heads, one each): the group's all-reduce sums in rank order, so a row's
bits do not depend on its company there either."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import structlog

from service.config import Config, default_cache_dir
from service.engine.assembly import open_engine
from service.engine.engine import Engine
from service.engine.request import SamplingParams, SamplingSpec
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer
from tests.sim_worker import RecordingObserver, run_together

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime, in one sentence each. "
    "Then say which of them is the largest, and spell it out in words, please.",
]
DTYPES = ("float32", "bfloat16")
# Preemption and the prefix cache are the scheduler's: once in the dtype users get (a row's
# independence of its company and of its chunks, which these outputs rest on, is checked in
# both dtypes by tests/test_worker_batch_invariance.py, and above)
USERS_DTYPE = ("bfloat16",)
# (dtype, tensor parallel size): one worker in each dtype; the group in the users' dtype
# after preemption (its company and chunks change its rows' bits no more than one worker's:
# tests/test_worker_group.py shows its answers equal one worker's, for CI time)
USERS_ALONE_AND_GROUPED = [(d, tp) for d in USERS_DTYPE for tp in (1, 3)]
PREEMPTED = "request.preempted"


def block_bytes(dtype: str) -> int:
    """One KV block of SmolLM2-135M: K and V, 30 layers, 3 heads x 64, 16 slots."""
    return 2 * 30 * 3 * 64 * 16 * (4 if dtype == "float32" else 2)


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(None, default_cache_dir())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


def prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in QUESTIONS
    ]


@asynccontextmanager
async def started(
    config: Config, model_dir, tokenizer
) -> AsyncIterator[tuple[Engine, RecordingObserver]]:
    async with open_engine(config, model_dir=model_dir, tokenizer=tokenizer) as engine:
        observer = RecordingObserver()
        engine.add_observer(observer)
        yield engine, observer


ARGMAX = SamplingSpec(temperature=0.0)
GREEDY = SamplingParams(max_tokens=16, sampling=ARGMAX)


@pytest.mark.parametrize(("dtype", "tp"), [(d, 1) for d in DTYPES])
async def test_greedy_same_alone_together_and_with_chunk_16_or_512(model_dir, tokenizer, dtype, tp):
    config = Config(
        dtype=dtype, device="cpu", kv_memory=0.05, use_cuda_graphs=False, tensor_parallel_size=tp
    )
    config.policy_params = {"token_budget": 512, "chunk_size": 512}
    token_lists = prompts(tokenizer)
    async with started(config, model_dir, tokenizer) as (engine, _):
        alone = [
            (await run_together(engine, [ids], GREEDY, f"alone{i}"))[0]
            for i, ids in enumerate(token_lists)
        ]
        together = await run_together(engine, token_lists, GREEDY, "together")
        engine.set_policy("stall_free", {"token_budget": 64, "chunk_size": 16})
        chunked = await run_together(engine, token_lists, GREEDY, "chunk16")
        engine.set_policy("fcfs", {})
        whole = await run_together(engine, token_lists, GREEDY, "fcfs")
    for i, ids in enumerate(alone):
        print(repr(tokenizer.decode(ids)))
        assert len(ids) >= 1
        assert together[i] == ids, f"prompt {i}: batch company changed the output"
        assert chunked[i] == ids, f"prompt {i}: chunk 16 changed the output"
        assert whole[i] == ids, f"prompt {i}: whole-prompt prefill changed the output"
    assert "Paris" in tokenizer.decode(alone[0])


@pytest.mark.parametrize(("dtype", "tp"), USERS_ALONE_AND_GROUPED)
async def test_greedy_same_after_forced_preemption(model_dir, tokenizer, dtype, tp):
    params = SamplingParams(max_tokens=24, ignore_eos=True, sampling=ARGMAX)
    token_lists = prompts(tokenizer)
    # room for 10 blocks: each request alone fits, all three together do not
    tight = Config(
        dtype=dtype,
        device="cpu",
        kv_memory=11 * block_bytes(dtype),
        use_cuda_graphs=False,
        watermark=0.0,
        tensor_parallel_size=tp,
    )
    async with started(tight, model_dir, tokenizer) as (engine, observer):
        print("tight KV blocks:", engine.handshake.num_blocks)
        reference = [
            (await run_together(engine, [ids], params, f"alone{i}"))[0]
            for i, ids in enumerate(token_lists)
        ]
        assert not observer.preempted  # alone, nobody is short of blocks
        with structlog.testing.capture_logs() as logs:
            squeezed = await run_together(engine, token_lists, params, "together")
    preempted = [(e["request_id"], e["num_generated"]) for e in logs if e["event"] == PREEMPTED]
    print("preempted (request, tokens generated by then):", preempted)
    assert preempted, "the tight cache did not force a preemption"
    for i, (tokens, solo) in enumerate(zip(squeezed, reference, strict=True)):
        assert tokens == solo, (
            f"request {i} differs from its solo run at token {first_difference(tokens, solo)}"
        )


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where a and b differ (the shorter length if none)."""
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_offline_generate_matches_the_engine(tokenizer, dtype):
    from service.offline import LLM

    llm = LLM(dtype=dtype, device="cpu", kv_memory=0.05, use_cuda_graphs=False)
    text_prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    outs = llm.generate([text_prompt, tokenizer.encode(text_prompt)], GREEDY)
    assert len(outs) == 2
    assert outs[0].token_ids == outs[1].token_ids
    assert "Paris" in outs[0].text
    assert outs[0].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="unknown config"):
        LLM(not_an_option=1)


def test_offline_generate_queues_a_batch_beyond_the_servers_token_bound(tokenizer):
    from service.offline import LLM

    # one runs at a time, so a server would refuse the fourth 3,000-token prompt (9,000
    # tokens waiting > the 8,192 the bound never goes below); a batch is submitted at once
    # and must all be queued. The prompts share all but their last block, so that after the
    # first the prefix cache prefills each in a few tokens (the bound counts whole prompts).
    llm = LLM(dtype="float32", device="cpu", max_num_seqs=1, max_queued_tokens=1)
    shared = [tokenizer.bos_token_id or 1] + [100] * 2983
    prompts = [shared + [100 + i] * 16 for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, sampling=ARGMAX))
    assert [out.finish_reason for out in outs] == ["length"] * 4


SYSTEM = (
    "You are a patient teacher at a school by the sea. You answer questions from pupils "
    "aged ten to fourteen. Keep every answer short, friendly and exact; use simple words; "
    "never invent facts; if you are not sure, say so. When a pupil asks about numbers, show "
    "the working in one line. When a pupil asks about places, name the country and the "
    "continent. When a pupil asks for a poem, keep to the form they asked for and count the "
    "syllables. End every answer with a question that makes the pupil think a little more "
    "about what they have just learned, unless the pupil asked you not to. "
) * 2


def shared_prompts(tokenizer) -> list[list[int]]:
    """The three questions behind one long system prompt: ~20 full blocks shared."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            )
        )
        for q in QUESTIONS
    ]


# One worker: the cache's hits and evictions are the scheduler's, and a group's ranks hold
# the same tables for them (tests/test_tensor_parallel_follow.py); the group's
# answers equal one worker's after preemption and recompute, above.
@pytest.mark.parametrize(("dtype", "tp"), [(d, 1) for d in USERS_DTYPE])
async def test_greedy_same_with_the_prefix_cache_on_and_off(model_dir, tokenizer, dtype, tp):
    """Alone, again (the whole prompt but its last block cached), together, and on a
    cache so tight that sequences are preempted and cached blocks evicted: every output
    equals the one computed with the prefix cache off."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, sampling=ARGMAX)
    token_lists = shared_prompts(tokenizer)
    base = {
        "dtype": dtype,
        "device": "cpu",
        "use_cuda_graphs": False,
        "watermark": 0.0,
        "tensor_parallel_size": tp,
    }
    off = Config(**base, kv_memory=0.05, enable_prefix_caching=False)
    async with started(off, model_dir, tokenizer) as (engine, _):
        reference = [
            (await run_together(engine, [ids], params, f"off{i}"))[0]
            for i, ids in enumerate(token_lists)
        ]
    async with started(Config(**base, kv_memory=0.05), model_dir, tokenizer) as (engine, seen):
        alone = [
            (await run_together(engine, [ids], params, f"alone{i}"))[0]
            for i, ids in enumerate(token_lists)
        ]
        again = await run_together(engine, token_lists[:1], params, "again")
        together = await run_together(engine, token_lists, params, "together")
    cached = {s.request_id: s.cached_tokens for s in seen.finished}
    print("cached prompt tokens:", cached, "prompt lengths:", [len(t) for t in token_lists])
    assert cached["alone0-0"] == 0 and cached["alone1-0"] >= 16 * 15  # the system prompt
    assert cached["again-0"] == (len(token_lists[0]) - 1) // 16 * 16
    # room for ~25 blocks: one request fits, three beside one another do not
    tight = Config(**base, kv_memory=26 * block_bytes(dtype))
    async with started(tight, model_dir, tokenizer) as (engine, _):
        with structlog.testing.capture_logs() as logs:
            squeezed = await run_together(engine, token_lists, params, "tight")
            for i, ids in enumerate(reversed(token_lists)):  # from evictable blocks, or not
                squeezed.append((await run_together(engine, [ids], params, f"after{i}"))[0])
        state = engine.state()["prefix_cache"]
    print("tight:", state, "preempted:", sum(e["event"] == PREEMPTED for e in logs))
    assert any(e["event"] == PREEMPTED for e in logs), "the tight cache forced no preemption"
    assert state["evicted_blocks"] > 0 and state["hits_tokens"] > 0
    expected = [*reference, *reversed(reference)]
    for name, outputs, wanted in [
        ("alone", alone, reference),
        ("again", again, reference[:1]),
        ("together", together, reference),
        ("tight", squeezed, expected),
    ]:
        for i, (tokens, solo) in enumerate(zip(outputs, wanted, strict=True)):
            assert tokens == solo, (
                f"{name} {i} differs from the cache-off run at token "
                f"{first_difference(tokens, solo)}"
            )
