"""Speculative decoding's parts alone (service.engine.speculation): the config, the n-gram
proposer, a request's acceptance record, and the allowance a step's drafts get."""

from __future__ import annotations

import argparse
import itertools
import math

import pytest

from gpu_worker.protocol import TokenLogprobs
from policies.base import StepCost
from service.cli import add_serve_args, config_from_args
from service.engine import speculation
from service.engine.acceptance import PROBE_EVERY, Acceptance
from service.engine.request import SamplingParams, SamplingSpec
from service.engine.speculation import (
    _UNFITTED_STEP_TOKENS,
    _WINDOW,
    DraftAllowance,
    SpeculativeConfig,
    Speculator,
    draft_ms,
    may_draft,
    parse_speculative_config,
    propose_ngram,
)
from service.engine.step_cost import StepCostModel, plan_terms
from service.flag_types import speculative_config
from tests.scheduler_helpers import make_request

# ---- config -------------------------------------------------------------------------------


def test_config_takes_vllms_fields():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
    text += '"prompt_lookup_min": 1, "step_cost_tolerance": 0.1}'
    assert parse_speculative_config(text) == SpeculativeConfig("ngram", 3, 5, 1, 0.1)


@pytest.mark.parametrize(
    ("given", "lookup"),
    [({}, (2, 4)), ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 5}, (5, 5))],
)
def test_a_missing_lookup_bound_takes_the_others(given: dict, lookup: tuple[int, int]):
    fields = ", ".join(f'"{k}": {v}' for k, v in given.items())
    text = '{"method": "ngram", "num_speculative_tokens": 2' + (", " + fields if fields else "")
    config = parse_speculative_config(text + "}")
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == lookup


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ngram", "JSON object"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be 'ngram'"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "1..64"),
        ('{"method": "ngram", "num_speculative_tokens": 2.5}', "integer"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "no model"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "mode": "x"}', "unknown"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a model"),
        ('{"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 2}', "takes no"),
        ('{"model": "d", "num_speculative_tokens": 2, "quantization": "fp4"}', "one of"),
        ('{"model": "d"}', "needs num_speculative_tokens"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min must be <= prompt_lookup_max",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "step_cost_tolerance": 2}', "0..1"),
    ],
)
def test_a_wrong_config_says_what_is_wrong(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text)
    with pytest.raises(argparse.ArgumentTypeError, match=message):  # the flag's error
        speculative_config(text)


def test_a_config_that_names_a_model_is_the_draft_models():
    text = '{"model": "/m/draft", "num_speculative_tokens": 3, "quantization": "int4"}'
    expected = SpeculativeConfig(
        "draft_model", 3, model="/m/draft", quantization="int4", step_cost_tolerance=0.05
    )
    assert parse_speculative_config(text) == expected
    text = '{"method": "draft_model", "model": "d", "num_speculative_tokens": 2}'
    assert parse_speculative_config(text).quantization == "none"


def test_the_flag_sets_the_config_and_a_wrong_one_is_a_usage_error(capsys):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert config_from_args(parser.parse_args([])).speculative_config is None  # off
    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    config = config_from_args(parser.parse_args(["--speculative-config", flag]))
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert "needs num_speculative_tokens" in capsys.readouterr().err


# ---- the n-gram proposer --------------------------------------------------------------------


def test_no_earlier_occurrence_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4, 5, 6], 4, 2, 4) == []
    assert propose_ngram([7, 7], 4, 2, 4) == []  # too short for an earlier bigram
    assert propose_ngram([1, 2, 3, 1, 2], 0, 2, 4) == []


def test_proposes_what_followed_the_most_recent_occurrence():
    tokens = [9, 1, 2, 3, 9, 1, 2, 8, 9, 1, 2]
    assert propose_ngram(tokens, 2, 1, 3) == [8, 9]


def test_the_longest_suffix_found_wins():
    # the bigram (3, 4) last occurred before 7; the trigram (2, 3, 4) before 5
    tokens = [2, 3, 4, 5, 0, 3, 4, 7, 0, 2, 3, 4]
    assert propose_ngram(tokens, 1, 2, 3) == [5]
    assert propose_ngram(tokens, 1, 2, 2) == [7]


def test_k_bounds_the_proposal_and_a_match_at_the_end_repeats_itself():
    tokens = [5, 1, 2, 3, 1, 2, 3, 1, 2]
    assert propose_ngram(tokens, 2, 2, 2) == [3, 1]
    # the occurrence just before the suffix: its continuation runs into the suffix and on
    assert propose_ngram([4, 4, 4], 3, 2, 2) == [4, 4, 4]
    assert propose_ngram([1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]


def test_the_lookup_reads_a_bounded_window():
    filler = list(range(10, 10 + _WINDOW))
    assert propose_ngram([1, 2, 3, *filler[: _WINDOW - 5], 1, 2], 1, 2, 2) == [3]
    # the window's first token is the 3: the (1, 2) before it is not read
    assert propose_ngram([1, 2, 3, *filler[: _WINDOW - 3], 1, 2], 1, 2, 2) == []


# ---- acceptance ---------------------------------------------------------------------------


def test_rejected_drafts_lower_k_to_zero_then_a_probe_comes_and_success_raises_it():
    record = Acceptance()
    assert record.wanted(4) == 4
    ks: list[int] = []
    while not ks or ks[-1]:
        ks.append(record.wanted(4))
        record.record(ks[-1], 0)
    assert ks[0] == 4 and ks == sorted(ks, reverse=True) and len(ks) < 12
    for _ in range(PROBE_EVERY - 2):  # one decode without drafts is counted already
        record.record(0, 0)
    assert record.wanted(4) == 0
    record.record(0, 0)
    assert record.wanted(4) == 1  # the probe
    for _ in range(10):
        record.record(record.wanted(4), record.wanted(4))
    assert record.wanted(4) == 4
    assert record.wanted(2) == 2 and record.wanted(0) == 0


def test_totals_count_every_verified_draft():
    record = Acceptance()
    record.record(4, 3)
    record.record(2, 0)
    record.record(0, 0)
    assert (record.drafted, record.accepted) == (6, 3)


@pytest.mark.parametrize(
    ("sampling", "drafts"),
    [
        (SamplingSpec(), True),
        (SamplingSpec(temperature=0.8), True),  # unseeded: rejection sampling keeps it
        (SamplingSpec(temperature=0.8, seed=3), True),  # the worker keeps its tokens
        (SamplingSpec(presence_penalty=0.5), False),
        (SamplingSpec(min_tokens=2), False),
        (SamplingSpec(bad_words=[[1, 2]]), False),
        (SamplingSpec(logprobs=True, top_logprobs=2), True),
    ],
)
def test_which_requests_draft(sampling: SamplingSpec, drafts: bool):
    request = make_request(0, 8)
    request.params = SamplingParams(max_tokens=8, sampling=sampling)
    assert may_draft(request) is drafts


def test_structured_output_pooling_and_prompt_logprobs_in_flight_never_draft():
    request = make_request(0, 8)
    assert may_draft(request)
    request.grammar = object()  # type: ignore[assignment]
    assert not may_draft(request)
    request = make_request(1, 8)
    request.params = SamplingParams(max_tokens=0, pooling="last")
    assert not may_draft(request)
    request = make_request(2, 8)
    request.params = SamplingParams(max_tokens=8, sampling=SamplingSpec(prompt_logprobs=1))
    request.prompt_logprobs = TokenLogprobs()  # none computed yet
    assert not may_draft(request)


# ---- the allowance ------------------------------------------------------------------------


def decode_model(cost: StepCost, batches: tuple[int, ...]) -> StepCostModel:
    """A model fitted to decode steps of these batch sizes (at varied contexts) whose
    times `cost` gives."""
    model = StepCostModel()
    for n in batches:
        starts = [(37 * i + 11 * n) % 300 for i in range(n)]
        model.observe_plan([1] * n, starts, cost.step_ms(*plan_terms([1] * n, starts)))
    return model


def test_before_a_fit_only_a_small_decode_only_step_whose_rows_all_draft_drafts():
    speculator = Speculator(SpeculativeConfig())
    steps = StepCostModel()
    small = speculator.allowance(steps, [1, 1], [10, 20], 500, self_paid=2.0)
    assert (small.tokens, small.extra_ms) == (_UNFITTED_STEP_TOKENS - 2, math.inf)
    assert speculator.allowance(steps, [1, 1], [10, 20], 5, self_paid=2.0).tokens == 5
    assert speculator.allowance(steps, [1, 1], [10, 20], 500).tokens == 0  # others would pay
    assert speculator.allowance(steps, [1, 32], [10, 0], 500, self_paid=2.0).tokens == 0
    wide = speculator.allowance(steps, [1] * _UNFITTED_STEP_TOKENS, [0] * 16, 500, self_paid=2.0)
    assert wide.tokens == 0


def test_drafts_take_what_the_tolerance_leaves_of_the_predicted_step():
    """Cheap rows (a memory-bound decode) draft fully; dear ones (a full batch) hardly."""
    speculator = Speculator(SpeculativeConfig(step_cost_tolerance=0.05))
    cheap = StepCost(base_ms=20.0, ms_per_token=0.01, ms_per_pair=0.0, ms_per_context=0.0)
    speculator.decode_cost = decode_model(cheap, (1, 2, 3, 5, 8, 1, 2, 4, 6, 7))
    allowance = speculator.allowance(StepCostModel(), [1], [100], 500)
    assert allowance.take(100, 4) == 4
    dear = StepCost(base_ms=5.0, ms_per_token=0.5, ms_per_pair=0.0, ms_per_context=0.0)
    speculator.decode_cost = decode_model(dear, (32, 40, 48, 64, 56, 60, 33, 50, 64, 64))
    allowance = speculator.allowance(StepCostModel(), [1] * 64, [100] * 64, 448)
    # 5 % of 5 + 32 ms is 1.85 ms: three drafts at 0.5 ms, then nothing for anyone
    assert [allowance.take(100, 4) for _ in range(3)] == [3, 0, 0]


def test_a_draft_is_priced_by_the_keys_its_queries_read():
    cost = StepCost(base_ms=0.0, ms_per_token=0.0, ms_per_pair=0.0, ms_per_context=0.001)
    # queries at 1001..1003 read 1001 + 1002 + 1003 keys (the decode's own 1000 aside)
    assert draft_ms(cost, 1000, 3) == pytest.approx(0.001 * 3006)
    assert plan_terms([4, 1], [1000, 50], [3, 0]) == (5, 0, 4006 + 50)
    assert plan_terms([4], [1000], [0]) == (4, 4 * 1000 + 10, 0)  # a prefill chunk


def test_a_spent_allowance_looks_nothing_up(monkeypatch: pytest.MonkeyPatch):
    """At a full batch most decodes find no time left: they cost no lookup either."""
    looked = []
    monkeypatch.setattr(speculation, "propose_ngram", lambda *a: looked.append(a) or [1, 2])
    speculator = Speculator(SpeculativeConfig())
    cost = StepCost(base_ms=10.0, ms_per_token=1.0, ms_per_pair=0.0)
    request = make_request(0, 8, max_tokens=16)
    spent = DraftAllowance(tokens=100, extra_ms=0.5, cost=cost)
    assert speculator.draft(request, spent, room=4).tokens == [] and not looked
    open_ = DraftAllowance(tokens=100, extra_ms=2.5, cost=cost)
    assert speculator.draft(request, open_, room=4).tokens == [1, 2] and len(looked) == 1
    assert looked[0][1] == 2  # it asks for no more than the allowance takes


def test_prefill_steps_do_not_teach_the_decode_model():
    speculator = Speculator(SpeculativeConfig())
    for _ in range(10):
        speculator.observe([1, 64], [10, 0], [0, 0], 50.0)
    assert speculator.decode_cost.estimate() is None
    for _ in range(10):
        speculator.observe([1, 5], [10, 20], [0, 4], 10.0)
    assert speculator.decode_cost.estimate() is not None


# ---- a draft model's measured payoff ------------------------------------------------------


def run_payoff(drafting_ms: float, plain_ms: float, steps: int) -> list[bool]:
    """Whether each of `steps` steps of one row drafts, drafts costing `drafting_ms` a step
    (one accepted: two tokens) and a plain step `plain_ms`."""
    payoff, chosen = speculation.Payoff(), []
    for _ in range(steps):
        drafts = payoff.drafts()
        chosen.append(drafts)
        step_ms = drafting_ms if drafts else plain_ms
        payoff.record(1, drafts, 1 if drafts else 0, step_ms)
    return chosen


def test_drafts_that_pay_go_on_and_the_plain_way_is_probed_now_and_then():
    chosen = run_payoff(drafting_ms=15.0, plain_ms=10.0, steps=60)  # 7.5 ms a token drafting
    assert chosen[:PROBE_EVERY] == [True] * PROBE_EVERY
    plain = [i for i, drafts in enumerate(chosen) if not drafts]
    assert plain and all(b - a == PROBE_EVERY + 1 for a, b in itertools.pairwise(plain))


def test_drafts_that_cost_more_than_they_bring_stop_but_for_probes():
    chosen = run_payoff(drafting_ms=25.0, plain_ms=10.0, steps=60)  # 12.5 ms a token drafting
    assert chosen[:PROBE_EVERY] == [True] * PROBE_EVERY
    later = chosen[PROBE_EVERY:]
    assert 0 < sum(later) <= len(later) // PROBE_EVERY


def test_only_a_probe_of_dearer_drafts_is_a_probe_that_drafts():
    """Payoff.probing: the steps whose drafts the allowance must not bound (speculation's
    module docstring), and no others."""
    payoff, probes = speculation.Payoff(), []
    for _ in range(60):
        drafts, probing = payoff.drafts(), payoff.probing()
        assert not probing or drafts
        probes.append(probing)
        payoff.record(1, drafts, 1 if drafts else 0, 25.0 if drafts else 10.0)
    assert not any(probes[:PROBE_EVERY])
    assert 0 < sum(probes) <= 60 // PROBE_EVERY
