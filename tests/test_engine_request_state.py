"""A request's own bookkeeping: token counts, what is left to compute, preemption, sampling.

The scheduler and the engine read these properties every iteration; a wrong `remaining`
would schedule a decode as a prefill (or the reverse), and a lost preemption count would
hide preemptions from the logs and metrics. `params.sampling` is what reaches the worker, as is.
"""

from __future__ import annotations

import trio

from gpu_worker.protocol import SamplingSpec
from service.engine.detokenizer import Detokenizer
from service.engine.request import Request, SamplingParams, Status
from tests.sim_worker import SimTokenizer


def make_request(prompt_len: int = 5, generated: int = 0) -> Request:
    send, _ = trio.open_memory_channel(10)
    params = SamplingParams()
    prompt = list(range(1, prompt_len + 1))
    return Request(
        request_id="r",
        seq_id=0,
        prompt_len=prompt_len,
        token_ids=prompt + [9] * generated,
        params=params,
        tenant="t",
        priority=0,
        received=0.0,
        stream=send,
        detokenizer=Detokenizer(SimTokenizer(), prompt, []),
    )


def test_a_new_request_waits_with_nothing_computed():
    r = make_request(5)
    assert r.status is Status.WAITING and not r.is_finished
    assert (r.num_tokens, r.num_generated, r.num_computed_tokens, r.remaining) == (5, 0, 0, 5)
    assert r.preemptions == 0 and r.admitted_order == -1


def test_remaining_shrinks_with_the_cache_and_is_one_for_a_decode():
    r = make_request(5)
    r.num_computed_tokens = 3
    assert r.remaining == 2
    r.num_computed_tokens = 5  # prefilled: the first token is sampled from the last position
    assert r.remaining == 1
    r.token_ids.append(42)
    assert (r.num_tokens, r.num_generated, r.remaining) == (6, 1, 1)


def test_preemption_keeps_the_tokens_and_counts_every_time():
    r = make_request(5, generated=3)
    r.status, r.num_computed_tokens = Status.RUNNING, 7
    r.reset_for_recompute()
    assert r.status is Status.WAITING and r.num_computed_tokens == 0
    assert r.num_generated == 3 and r.remaining == 8  # prompt and output recomputed
    r.status, r.num_computed_tokens = Status.RUNNING, 8
    r.reset_for_recompute()
    assert r.preemptions == 2


def test_only_the_finished_status_is_finished():
    r = make_request()
    for status in (Status.WAITING, Status.RUNNING):
        r.status = status
        assert not r.is_finished
    r.status = Status.FINISHED
    assert r.is_finished


def test_default_sampling_is_unseeded_full_distribution_sampling():
    # OpenAI's and vLLM's defaults: temperature 1, no top-p or top-k cut, unseeded
    assert SamplingParams().sampling == SamplingSpec(
        temperature=1.0, top_p=1.0, top_k=0, seed=None, logprobs=False
    )
    assert SamplingParams().sampling is not SamplingParams().sampling  # never shared
