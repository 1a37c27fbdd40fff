"""`n` sequences of one prompt in the engine, on the simulated worker: one stream carries
every sequence's events, tagged with its index, and closes after the last finish; the
sequences after the first start once it has computed the prompt, from its cached blocks;
aborting the request ends all of them."""

from __future__ import annotations

import collections

import pytest
import trio

from gpu_worker.protocol import SamplingSpec
from service.engine.request import FinishEvent, SamplingParams, TokenEvent
from service.engine.sequences import sibling_params
from tests.sim_worker import SimWorker, expected_tokens, greedy, running_engine, sim_config

PROMPT = [(7 * i) % 90 + 32 for i in range(100)]  # six full blocks of 16, and 4 tokens


async def collect_sequences(channel: trio.MemoryReceiveChannel):
    """Each index's token ids and finish, read to the end of the shared stream."""
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    finishes: dict[int, FinishEvent] = {}
    async for event in channel:
        assert event.index not in finishes, "an event after its sequence's FinishEvent"
        if isinstance(event, TokenEvent):
            tokens[event.index] += event.token_ids
        else:
            finishes[event.index] = event
    return tokens, finishes


def first_starts(worker: SimWorker) -> dict[int, int]:
    """Where each sequence's first chunk began, by seq_id."""
    starts: dict[int, int] = {}
    for plan in worker.plans:
        for seq_id, start in zip(plan.seq_ids, plan.start_pos, strict=True):
            starts.setdefault(seq_id, start)
    return starts


async def test_n_sequences_share_one_stream_and_the_prompts_blocks(autojump_clock):
    worker = SimWorker()
    async with running_engine(sim_config(), worker) as engine:
        channel = await engine.submit(PROMPT, greedy(6), request_id="r", n=3)
        tokens, finishes = await collect_sequences(channel)
        state = engine.state()
    assert sorted(finishes) == [0, 1, 2]
    assert all(tokens[i] == expected_tokens(PROMPT, 6) for i in range(3))
    assert [finishes[i].cached_tokens for i in range(3)] == [0, 96, 96]
    assert sorted(first_starts(worker).values()) == [0, 96, 96]
    assert state["kv_blocks_used"] == 0 and state["running"] == state["waiting"] == 0


async def test_without_the_prefix_cache_each_sequence_computes_the_prompt(autojump_clock):
    worker = SimWorker()
    async with running_engine(sim_config(enable_prefix_caching=False), worker) as engine:
        channel = await engine.submit(PROMPT, greedy(4), request_id="r", n=2)
        tokens, finishes = await collect_sequences(channel)
    assert [tokens[i] for i in range(2)] == [expected_tokens(PROMPT, 4)] * 2
    assert sorted(first_starts(worker).values()) == [0, 0]
    assert [finishes[i].cached_tokens for i in range(2)] == [0, 0]


async def test_aborting_the_request_ends_every_sequence(autojump_clock):
    async with running_engine(sim_config()) as engine:
        channel = await engine.submit(PROMPT, greedy(1000), request_id="r", n=3)
        seen = 0
        async for _event in channel:
            seen += 1
            if seen == 5:  # the first sequence is decoding, the others may be held or not
                engine.abort("r")
                break
        _, finishes = await collect_sequences(channel)
        state = engine.state()
    assert sorted(finishes) == [0, 1, 2]
    assert {f.reason for f in finishes.values()} == {"abort"}
    assert state["kv_blocks_used"] == 0 and state["running"] == state["waiting"] == 0


async def test_a_request_id_whose_sibling_id_is_taken_is_refused(autojump_clock):
    from service.engine.validation import InvalidRequest

    async with running_engine(sim_config()) as engine:
        channel = await engine.submit(PROMPT, greedy(50), request_id="r-1")
        with pytest.raises(InvalidRequest):
            await engine.submit(PROMPT, greedy(5), request_id="r", n=2)
        engine.abort("r-1")
        await collect_sequences(channel)


async def test_a_huge_n_is_refused_before_anything_is_sized_by_it(autojump_clock):
    """The offline API reaches the engine without the HTTP layer's bounds: a billion
    sequence ids would take the process's memory before validation said no."""
    from service.engine.validation import InvalidRequest

    async with running_engine(sim_config()) as engine:
        with pytest.raises(InvalidRequest) as refused:
            await engine.submit(PROMPT, greedy(5), request_id="huge", n=10**9)
        assert refused.value.param == "n"


def test_a_seeded_requests_sequences_each_have_their_own_seed():
    seeded = SamplingParams(max_tokens=4, sampling=SamplingSpec(temperature=1.0, seed=40))
    assert [sibling_params(seeded, i).sampling.seed for i in range(3)] == [40, 41, 42]
    assert seeded.sampling.seed == 40  # the request's own params are not changed
    unseeded = SamplingParams(max_tokens=4)
    assert sibling_params(unseeded, 2).sampling.seed is None
