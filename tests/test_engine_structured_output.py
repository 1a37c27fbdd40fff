"""Structured output through the engine on the simulated worker (which takes a token its
plan's bitmask allows): plans carry masks for the constrained rows that sample only (none
for a prefill chunk), the output is JSON that fits the schema, the grammar's end finishes
the request, and a worker that ignores a mask fails only the request it constrains. Masks
fill in a thread: a slow one holds only its own request (beside a GPU's step, and between
a CPU worker's steps), and one that raises fails only its own."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import trio

from service.engine import masks
from service.engine.grammar import GrammarCompiler, ResponseFormat
from tests.plan_columns import column
from tests.sim_worker import (
    EOS,
    SimTokenizer,
    SimWorker,
    collect,
    expected_tokens,
    greedy,
    running_engine,
    sim_config,
    sim_tokenizer_info,
)

TOK = SimTokenizer()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "place": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
    },
    "required": ["name", "age", "color", "tags", "place"],
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(sim_tokenizer_info)


def constrained(compiler: GrammarCompiler, max_tokens: int = 200, **kw):
    params = greedy(max_tokens, **kw)
    params.grammar = compiler.compile(ResponseFormat("json_schema", json.dumps(SCHEMA)))
    return params


async def test_a_constrained_request_gets_json_beside_an_unchanged_free_one(
    autojump_clock, compiler
):
    worker = SimWorker()
    free_prompt = TOK.encode("free text")
    json_prompt = TOK.encode("a prompt long enough to be prefilled in chunks: " * 3)
    async with running_engine(sim_config(max_batched_tokens=48), worker) as engine:
        free_channel = await engine.submit(free_prompt, greedy(40), request_id="free")
        json_channel = await engine.submit(json_prompt, constrained(compiler), request_id="json")
        free, structured = await collect(free_channel), await collect(json_channel)
    assert free.token_ids == expected_tokens(free_prompt, 40)
    jsonschema.validate(json.loads(structured.text), SCHEMA)
    assert (structured.finish.reason, structured.finish.detail) == ("stop", "eos")
    assert structured.token_ids[-1] == EOS
    chunks = [plan for plan in worker.plans if 1 in plan.seq_ids]
    assert not chunks[0].sample[chunks[0].seq_ids.index(1)]  # a chunk that does not sample
    masked = [plan for plan in worker.plans if column(plan, "bitmask")]
    assert masked, "no plan carried a bitmask"
    for plan in masked:
        rows = [i for i, mask in enumerate(column(plan, "bitmask")) if mask is not None]
        assert [plan.seq_ids[i] for i in rows] == [1] and all(plan.sample[i] for i in rows)
    assert len(masked) == len(structured.token_ids)  # one mask per token sampled


async def test_a_one_token_prompt_gets_its_first_mask_before_any_step(compiler):
    # the real clock: a mocked one jumps its idle pings ahead while the mask's thread runs
    async with running_engine() as engine:
        channel = await engine.submit(TOK.encode("{"), constrained(compiler, 5), request_id="a")
        with trio.fail_after(5):  # a mask nobody fills would leave it waiting for ever
            events = await collect(channel)
    assert (events.finish.reason, events.finish.detail) == ("length", "max_tokens")
    assert len(events.token_ids) == 5


async def test_the_grammar_end_finishes_a_request_that_ignores_eos(autojump_clock, compiler):
    async with running_engine() as engine:
        channel = await engine.submit(
            TOK.encode("json"), constrained(compiler, ignore_eos=True), request_id="a"
        )
        events = await collect(channel)
    assert (events.finish.reason, events.finish.detail) == ("stop", "eos")
    assert events.token_ids[-1] == EOS and events.finish.completion_tokens < 200
    jsonschema.validate(json.loads(events.text), SCHEMA)


async def test_a_token_outside_the_grammar_fails_only_its_request(autojump_clock, compiler):
    worker = SimWorker(honour_bitmasks=False)
    prompt = TOK.encode("json")
    async with running_engine(worker=worker) as engine:
        free_channel = await engine.submit(prompt, greedy(10), request_id="free")
        json_channel = await engine.submit(prompt, constrained(compiler), request_id="json")
        free, structured = await collect(free_channel), await collect(json_channel)
    assert (structured.finish.reason, structured.finish.detail) == ("error", "grammar_rejected")
    assert structured.token_ids == [] and "does not allow" in structured.finish.error
    assert free.token_ids == expected_tokens(prompt, 10)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
async def test_a_slow_mask_holds_only_its_own_request(
    autojump_clock, compiler, monkeypatch: pytest.MonkeyPatch, device: str
):
    fill, slowed = masks.fill_masks, []

    def slow_first_fill(*args):
        if not slowed:
            slowed.append(True)
            time.sleep(0.5)  # real time, in the mask thread: the loop must not wait for it
        return fill(*args)

    monkeypatch.setattr(masks, "fill_masks", slow_first_fill)
    worker = SimWorker(device=device)
    free_prompt, json_prompt = TOK.encode("free text"), TOK.encode("json")
    async with running_engine(worker=worker) as engine:
        json_channel = await engine.submit(json_prompt, constrained(compiler), request_id="json")
        free_channel = await engine.submit(free_prompt, greedy(30), request_id="free")
        free, structured = await collect(free_channel), await collect(json_channel)
        corrections = engine.state()["corrections"]
    assert free.token_ids == expected_tokens(free_prompt, 30)
    jsonschema.validate(json.loads(structured.text), SCHEMA)
    steps_of = [plan.seq_ids for plan in worker.plans]
    json_id, free_id = 0, 1  # seq ids, in order of arrival
    first_sample = next(
        i
        for i, plan in enumerate(worker.plans)
        if json_id in plan.seq_ids and plan.sample[plan.seq_ids.index(json_id)]
    )
    assert max(i for i, seqs in enumerate(steps_of) if free_id in seqs) < first_sample
    assert corrections["grammar_mask_pending"] >= 1


async def test_a_mask_that_raises_fails_only_its_own_request(
    autojump_clock, compiler, monkeypatch: pytest.MonkeyPatch
):
    def broken(*args):
        raise RuntimeError("simulated xgrammar failure")

    monkeypatch.setattr(masks, "fill_masks", broken)
    prompt = TOK.encode("json")
    async with running_engine() as engine:
        json_channel = await engine.submit(prompt, constrained(compiler), request_id="json")
        free_channel = await engine.submit(prompt, greedy(10), request_id="free")
        free, structured = await collect(free_channel), await collect(json_channel)
    assert (structured.finish.reason, structured.finish.detail) == ("error", "grammar_error")
    assert "simulated xgrammar failure" in structured.finish.error
    assert free.token_ids == expected_tokens(prompt, 10)
