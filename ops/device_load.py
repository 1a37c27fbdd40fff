"""The load the device check's promise sections (ops.device_promise) put on the service it
keeps: how large it is (on the H200, and with --quick on a CPU), the interference
scenario's streams and long prompts under each policy, and the capacity sweep; each summed
up as the rows of the report's tables.

It drives the server with `cadence bench`'s own pieces (ops.client's timed streaming
requests, ops.scenarios' workloads, ops.summary's windows, ops.capacity's sweep), with one
difference in the interference scenario: the long prompts are sent one after the other,
each once the streams have decoded alone for a while (and the next once it has been
answered), and the streams are cut once the last has been; rather than at fixed times,
with streams long enough to outlast them. So the streams decode through every prompt, and
the load lasts as long as the prompts take, on any device.

Prompts are words of the check's word-level tokenizer (`w3 w4 ...`): its vocabulary is the
corpus, so a prompt of N words is N tokens.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ops import capacity as sweep_runs
from ops import scenarios
from ops.client import (
    ClientConfig,
    RequestRecord,
    RequestSpec,
    discover_model,
    new_record,
    open_client,
    request_body,
    request_headers,
    run_workload,
    send_timed,
    set_policy,
)
from ops.log_parse import parse_log
from ops.prompts import PromptMaker, load_codec
from ops.summary import distribution, gaps, interference_windows

if TYPE_CHECKING:
    from ops.device_serve import Server


@dataclass(frozen=True, slots=True)
class InterferenceLoad:
    streams: int
    stream_prompt: int
    stream_tokens: int  # each stream's max_tokens: more than it decodes before it is cut
    prompts: tuple[int, ...]  # the long prompts' tokens, in their order of arrival
    prompt_tokens: int  # each long prompt's output tokens
    settle_s: float  # decoding alone before the first prompt, between prompts and after


@dataclass(frozen=True, slots=True)
class CapacityLoad:
    rates: tuple[float, ...]  # requests/s
    duration_s: float  # of arrivals, at each rate
    prompt_median: int
    prompt_clip: tuple[int, int]
    output_median: int
    output_clip: tuple[int, int]
    doc_share: float
    doc_len: tuple[int, int]
    ttft_ms: float
    itl_p99_ms: float
    attainment: float  # the share of requests that must meet both targets


# On the H200: the scenario at the 1B model's context (32,768 tokens), and a mixed
# load around what one such GPU serves, each within about 15 s of load.
FULL_INTERFERENCE = InterferenceLoad(
    streams=16,
    stream_prompt=64,
    stream_tokens=4096,
    prompts=(8192, 32000),
    prompt_tokens=4,
    settle_s=0.5,
)
FULL_CAPACITY = CapacityLoad(
    rates=(5.0, 15.0, 30.0),
    duration_s=3.0,
    prompt_median=256,
    prompt_clip=(16, 2048),
    output_median=64,
    output_clip=(8, 256),
    doc_share=0.1,
    doc_len=(2000, 4000),
    ttft_ms=500.0,
    itl_p99_ms=50.0,
    attainment=0.9,
)
# On a CPU, the tiny model's 1,024-token context: the same code, a few seconds of load.
QUICK_INTERFERENCE = InterferenceLoad(
    streams=4,
    stream_prompt=16,
    stream_tokens=1000,  # the context, less the prompt and a BOS
    prompts=(256, 1000),
    prompt_tokens=4,
    settle_s=0.3,
)
QUICK_CAPACITY = CapacityLoad(
    rates=(2.0, 4.0, 8.0),
    duration_s=1.5,
    prompt_median=32,
    prompt_clip=(8, 256),
    output_median=16,
    output_clip=(4, 48),
    doc_share=0.1,
    doc_len=(300, 600),
    ttft_ms=2000.0,
    itl_p99_ms=500.0,
    attainment=0.9,
)
POLICIES = ("fcfs", "stall_free")  # stall_free last: the server is left as it started
REQUEST_TIMEOUT_S = 120.0
STREAMING_TIMEOUT_S = 60.0  # until every stream has its first token


def word_prompts(server: Server, vocab: int) -> PromptMaker:
    """Prompts cut from the tokenizer's own words, measured with the tokenizer."""
    words = " ".join(f"w{i}" for i in range(3, vocab))
    return PromptMaker(load_codec(str(server.model)), words)


def client_config(server: Server, model: str) -> ClientConfig:
    return ClientConfig(base_url=server.url, model=model, timeout_s=REQUEST_TIMEOUT_S)


# ---- the interference scenario ---------------------------------------------------------------


def interference(
    server: Server, load: InterferenceLoad, vocab: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The scenario under each policy: a row per policy, a row per policy and prompt."""
    specs = scenarios.interference(
        word_prompts(server, vocab),
        random.Random(0),
        decoders=load.streams,
        decoder_prompt_len=load.stream_prompt,
        decoder_tokens=load.stream_tokens,
        injections=[scenarios.Injection(tokens, 0.0) for tokens in load.prompts],
        injected_tokens=load.prompt_tokens,
    )
    trio.run(_warm_up, server, next(spec for spec in specs if spec.role == "injected"))
    policies, prompts = [], []
    for policy in POLICIES:
        records, started, ended = trio.run(_run_policy, server, policy, specs, load.settle_s)
        steps = _worker_steps(server, policy, load.streams, started, ended)
        policy_row, prompt_rows = interference_rows(records, policy, steps)
        print(f"{policy_row}", flush=True)
        policies.append(policy_row)
        prompts += prompt_rows
    return policies, prompts


async def _warm_up(server: Server, prompt: RequestSpec) -> None:
    """The first long prompt alone, unmeasured: what a device does once (a kernel compiled
    for a shape, memory touched first) is not charged to the first policy's run."""
    config = client_config(server, await discover_model(server.url))
    (record,) = (await run_workload(config, [prompt])).records
    if not record.ok:
        raise RuntimeError(f"the warm-up request failed: {record.error}")


async def _run_policy(
    server: Server, policy: str, specs: list[RequestSpec], settle_s: float
) -> tuple[list[RequestRecord], float, float]:
    """The policy set, then the streams and prompts; their records, and the run's start
    and end (unix seconds)."""
    await set_policy(server.url, policy, {}, server.admin_token)
    config = client_config(server, await discover_model(server.url))
    started = time.time()
    records = await streams_under_prompts(config, specs, settle_s)
    return records, started, time.time()


async def streams_under_prompts(
    config: ClientConfig, specs: list[RequestSpec], settle_s: float
) -> list[RequestRecord]:
    """The decoders' streams started together; once each streams, the injected prompts,
    one at a time, each after `settle_s` of decoding alone; `settle_s` after the last
    one's answer, the streams are cut. A record per spec, in spec order."""
    records = [new_record(spec) for spec in specs]
    paired = list(zip(specs, records, strict=True))
    streams = [(spec, record) for spec, record in paired if spec.role == "decoder"]
    async with open_client(config) as client:
        t0 = trio.current_time()

        async def send(spec: RequestSpec, record: RequestRecord) -> None:
            body, headers = request_body(config, spec), request_headers(config, spec)
            await send_timed(client, config, "/v1/completions", body, headers, record, t0)

        async with trio.open_nursery() as nursery:
            for spec, record in streams:
                nursery.start_soon(send, spec, record)
            await _all_streaming([record for _, record in streams])
            for spec, record in paired:
                if spec.role == "injected":
                    await trio.sleep(settle_s)
                    await send(spec, record)
            await trio.sleep(settle_s)
            nursery.cancel_scope.cancel()  # the streams: the server sees them disconnect
    return records


async def _all_streaming(records: list[RequestRecord]) -> None:
    with trio.fail_after(STREAMING_TIMEOUT_S):
        while any(r.first_token_s is None and r.error is None for r in records):
            await trio.sleep(0.01)


def interference_rows(
    records: list[RequestRecord], policy: str, steps: dict[str, float | None]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A policy's row and its prompts' rows. A decode step is the streams' median gap
    outside every prompt's window (the client's clock, as the gaps it is compared with)."""
    windows = interference_windows(records)
    streams = [r for r in records if r.role == "decoder"]
    every = [g * 1000 for r in streams for g in gaps(r)]
    spans = [(w["window_s"][0], w["window_s"][1] or w["window_s"][0]) for w in windows]
    alone = [g * 1000 for r in streams for g in _gaps_outside(r, spans)]
    step = statistics.median(alone) if alone else None
    prompt_rows = [_prompt_row(policy, w, step) for w in windows]
    worst = max((row["gap_max_ms"] or 0.0 for row in prompt_rows), default=0.0)
    itl = distribution(every)
    row = {
        "policy": policy,
        "worst_gap_ms": _rounded(worst),
        "itl_p99_ms": _rounded(itl["p99"]),
        "itl_p50_ms": _rounded(itl["p50"]),
        "decode_step_ms": _rounded(step),
        "worst_gap_over_step": _ratio(worst, step),
        **steps,
    }
    return row, prompt_rows


def _gaps_outside(record: RequestRecord, spans: list[tuple[float, float]]) -> list[float]:
    """The record's gaps that overlap none of `spans` (as ops.summary's windows count)."""
    times = record.chunk_times
    return [
        b - a
        for a, b in itertools.pairwise(times)
        if not any(b > start and a < end for start, end in spans)
    ]


def _prompt_row(policy: str, window: dict[str, Any], step: float | None) -> dict[str, Any]:
    gap_ms = window["decoder_itl_ms"]
    return {
        "policy": policy,
        "prompt_tokens": window["prompt_len"],
        "ttft_ms": _rounded(window["injected_ttft_ms"]),
        "streams_active": window["decoders_active"],
        "gap_p99_ms": _rounded(gap_ms["p99"]),
        "gap_max_ms": _rounded(gap_ms["max"]),
        "gap_max_over_step": _ratio(gap_ms["max"], step),
    }


def _worker_steps(
    server: Server, policy: str, streams: int, started: float, ended: float
) -> dict[str, float | None]:
    """From the server's iteration log, the worker's times in this run: its median step of
    every stream decoding alone, and its largest step that computed prompt tokens."""
    steps = [
        step
        for step in parse_log(server.iterations).iterations
        if step.policy == policy and started <= step.ts <= ended
    ]
    decoding = [s.step_ms for s in steps if s.prefill_tokens == 0 and s.decode_seqs == streams]
    prefilling = [s.step_ms for s in steps if s.prefill_tokens > 0]
    return {
        "worker_decode_step_ms": _rounded(statistics.median(decoding) if decoding else None),
        "worker_largest_prefill_step_ms": _rounded(max(prefilling, default=None)),
    }


# ---- the capacity sweep ----------------------------------------------------------------------


def capacity(
    server: Server, load: CapacityLoad, vocab: int, context: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The sweep under `stall_free`: a row per rate, and the capacity it found."""
    sweep = sweep_runs.Sweep(
        rates=list(load.rates),
        duration_s=load.duration_s,
        seed=0,
        shape=_shape(load, context),
        ttft_ms=load.ttft_ms,
        itl_targets=[load.itl_p99_ms],
        attainment=load.attainment,
        bisect=0,
        bisect_target=load.itl_p99_ms,
    )
    maker = word_prompts(server, vocab)
    runs = trio.run(_sweep, server, maker, sweep)
    (found,) = sweep_runs.capacities(runs, sweep)
    return [rate_row(run) for run in runs], {
        "capacity_req_per_s": found["rate"],
        "lowest_failing_req_per_s": found["lowest_failing"],
    }


def _shape(load: CapacityLoad, context: int) -> scenarios.MixedShape:
    clip = scenarios.LengthRange
    return scenarios.MixedShape(
        prompt=scenarios.LogNormal(load.prompt_median, 1.0, clip(*load.prompt_clip)),
        output=scenarios.LogNormal(load.output_median, 0.8, clip(*load.output_clip)),
        doc_share=load.doc_share,
        doc=clip(*load.doc_len),
        context_window=context,
    )


async def _sweep(
    server: Server, maker: PromptMaker, sweep: sweep_runs.Sweep
) -> list[dict[str, Any]]:
    await set_policy(server.url, "stall_free", {}, server.admin_token)
    config = client_config(server, await discover_model(server.url))
    swept = {rate: sweep_runs.workload(maker, sweep, rate) for rate in sweep.rates}
    return await sweep_runs.run_sweep(config, maker, sweep, swept, "stall_free")


def rate_row(run: dict[str, Any]) -> dict[str, Any]:
    summary, (target,) = run["summary"], run["targets"]
    return {
        "rate_req_per_s": run["rate"],
        "requests": summary["requests"],
        "failed": summary["failed"],
        "attainment": round(target["attainment"], 3),
        "goodput_req_per_s": round(target["goodput_requests_per_s"], 3),
        "ttft_p50_ms": _rounded(summary["ttft_ms"]["p50"]),
        "ttft_p99_ms": _rounded(summary["ttft_ms"]["p99"]),
        "request_itl_p99_p50_ms": _rounded(run["request_itl_p99_ms"]["p50"]),
        "output_tok_per_s": _rounded(summary["output_tokens_per_s"]),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _ratio(gap: float | None, step: float | None) -> float | None:
    return None if gap is None or not step else round(gap / step, 2)
