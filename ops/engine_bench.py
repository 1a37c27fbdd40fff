"""Offline engine benchmark: N requests at once through the engine and a real worker, no HTTP.

    cadence bench engine --policy fcfs --policy stall_free       (64 x 256 prompt, 128 output)
    cadence bench engine --overlap both       (each policy with and without overlap)
    cadence bench engine --adapters a=DIR,b=DIR    (requests spread over LoRA adapters)

For each policy in turn it starts a fresh worker, warms it up, submits every request at
once (ignore_eos, greedy), and prints output tokens/s, TTFT and ITL percentiles (engine
clock, as the tokens are emitted), the service-side scheduling time per iteration against
the worker's step time, and how long the worker waited for each plan (its idle gap, which
overlapped scheduling is there to close). Greedy outputs are compared across runs: the
same prompts must give the same tokens whatever the schedule. With `--adapters`, request
i runs with adapter i mod their number (round robin; --max-loras slots, 4 by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ops.prompts import PromptMaker, codec_from_tokenizer_json
from ops.summary import distribution, format_table
from service.cli import add_config_flags
from service.config import Config
from service.engine.adapters import registry_at_start
from service.engine.assembly import open_engine
from service.engine.engine import Engine
from service.engine.request import FinishEvent, SamplingParams, SamplingSpec, TokenEvent
from service.engine.stats import IterationStats
from service.logging import configure_logging
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer

GREEDY = SamplingSpec(temperature=0.0)

CONFIG_FLAGS = (
    "model",
    "dtype",
    "kv_memory",
    "kv_cache_dtype",
    "kernels",
    "max_loras",
    "max_lora_rank",
)


@dataclass(slots=True)
class Timeline:
    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish: str = ""


class IterationRecorder:
    """An engine observer that keeps each iteration's stats."""

    def __init__(self) -> None:
        self.iterations: list[IterationStats] = []

    def on_iteration(self, stats: IterationStats) -> None:
        self.iterations.append(stats)

    def on_request_received(self, *args: object) -> None: ...
    def on_request_finished(self, *args: object) -> None: ...
    def on_preemption(self, *args: object) -> None: ...
    def on_policy_swap(self, *args: object) -> None: ...
    def on_request_refused(self, *args: object) -> None: ...
    def on_request_event(self, *args: object) -> None: ...


@dataclass(slots=True)
class PolicyRun:
    policy: str  # with its overlap setting
    seconds: float
    timelines: list[Timeline]
    iterations: list[IterationStats]


async def run_policy(
    config: Config, model_dir, tokenizer: Tokenizer, prompts: list[list[int]], output_len: int
) -> PolicyRun:
    recorder = IterationRecorder()
    params = [
        SamplingParams(
            max_tokens=output_len,
            ignore_eos=True,
            sampling=GREEDY,
            adapter=None if adapter is None else adapter[0],
            adapter_path=None if adapter is None else adapter[1],
        )
        for adapter in spread_adapters(config.lora_modules, len(prompts))
    ]
    timelines = [Timeline() for _ in prompts]
    async with open_engine(config, model_dir=model_dir, tokenizer=tokenizer) as engine:
        engine.add_observer(recorder)
        await _generate(engine, [prompts[0][:16]], [SamplingParams(max_tokens=4)], [Timeline()])
        recorder.iterations.clear()
        start = trio.current_time()
        await _generate(engine, prompts, params, timelines)
        seconds = trio.current_time() - start
    label = f"{config.policy} (overlap {config.overlap})"
    return PolicyRun(label, seconds, timelines, recorder.iterations)


def spread_adapters(modules: list[tuple[str, str]], count: int) -> list[tuple[str, str] | None]:
    """Each request's adapter (name, path), round robin; None: the base model."""
    if not modules:
        return [None] * count
    return [modules[i % len(modules)] for i in range(count)]


async def _generate(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    timelines: list[Timeline],
) -> None:
    async with trio.open_nursery() as readers:
        for i, (ids, timeline) in enumerate(zip(prompts, timelines, strict=True)):
            timeline.submitted = trio.current_time()
            request_id = f"bench-{i}-{time.time_ns()}"
            channel = await engine.submit(ids, params[i % len(params)], request_id=request_id)
            readers.start_soon(_read, channel, timeline)


async def _read(channel: trio.MemoryReceiveChannel, timeline: Timeline) -> None:
    async for event in channel:
        if isinstance(event, TokenEvent) and event.token_ids:
            now = trio.current_time()
            timeline.token_times.extend([now] * len(event.token_ids))
            timeline.token_ids.extend(event.token_ids)
        elif isinstance(event, FinishEvent):
            timeline.finish = event.reason


def summarize(run: PolicyRun) -> dict:
    tokens = sum(len(t.token_ids) for t in run.timelines)
    ttft = [(t.token_times[0] - t.submitted) * 1e3 for t in run.timelines if t.token_times]
    itl = [(b - a) * 1e3 for t in run.timelines for a, b in itertools.pairwise(t.token_times)]
    # the steady state: every request in the batch
    full = [s for s in run.iterations if s.num_seqs >= len(run.timelines)] or run.iterations
    step = sum(s.step_ms for s in full) / max(1, len(full))
    sched = sum(s.schedule_ms for s in full) / max(1, len(full))
    idle = distribution([s.worker_idle_ms for s in full if s.worker_idle_ms is not None])
    return {
        "policy": run.policy,
        "seconds": run.seconds,
        "tokens": tokens,
        "tok_s": tokens / run.seconds,
        "ttft": distribution(ttft),
        "itl": distribution(itl),
        "iterations": len(run.iterations),
        "step_ms": step,
        "schedule_ms": sched,
        "schedule_share": sched / step if step else 0.0,
        "idle": idle,
        "finished": sum(t.finish == "length" for t in run.timelines),
    }


def print_report(summaries: list[dict], runs: list[PolicyRun]) -> None:
    headers = [
        "policy",
        "s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "ITL max",
        "iters",
        "step ms",
        "sched ms",
        "sched/step",
        "idle ms",
        "idle p50",
    ]
    rows = [
        [
            s["policy"],
            f"{s['seconds']:.2f}",
            f"{s['tok_s']:.0f}",
            *(
                f"{s[k][q]:.0f}"
                for k, q in [
                    ("ttft", "p50"),
                    ("ttft", "p99"),
                    ("itl", "p50"),
                    ("itl", "p99"),
                    ("itl", "max"),
                ]
            ),
            s["iterations"],
            f"{s['step_ms']:.1f}",
            f"{s['schedule_ms']:.2f}",
            f"{100 * s['schedule_share']:.2f}%",
            *(_fine_ms(s["idle"][q]) for q in ("mean", "p50")),
        ]
        for s in summaries
    ]
    print(format_table(headers, rows))
    print(
        "(times in ms, engine clock; step/sched/idle ms: mean over steps running every request;"
        " idle: the worker's wait for each plan)"
    )
    base = runs[0]
    for other in runs[1:]:
        same = sum(
            a.token_ids == b.token_ids for a, b in zip(base.timelines, other.timelines, strict=True)
        )
        total = len(base.timelines)
        print(f"greedy outputs identical {base.policy} vs {other.policy}: {same}/{total}")


def _fine_ms(value: float | None) -> str:
    """Idle gaps are a few milliseconds or less: three decimals; none without a burst."""
    return "-" if value is None else f"{value:.3f}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cadence bench engine", description=__doc__.split("\n")[0]
    )
    add_config_flags(parser, CONFIG_FLAGS)  # as `cadence serve` takes them
    parser.set_defaults(kv_memory=2 * 1024**3)
    parser.add_argument("--policy", action="append", help="repeatable; default fcfs and stall_free")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="engine cap per step (default: the whole burst fits for fcfs)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--overlap",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="as `cadence serve --overlap` (auto: off on the CPU); both: off, then on",
    )
    parser.add_argument("--log-file", type=Path, default=None, help="the engine's JSON log lines")
    parser.add_argument(
        "--adapters",
        type=adapter_list,
        default=[],
        metavar="NAME=DIR,...",
        help="LoRA adapters (PEFT directories) the requests are spread over, round robin",
    )
    return parser


def adapter_list(text: str) -> list[tuple[str, str]]:
    """NAME=DIR,...; a bare DIR is named by its last part."""
    pairs = [item.partition("=") for item in text.split(",") if item]
    return [(name, path) if sep else (Path(name).name, name) for name, sep, path in pairs]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_file, "info" if args.log_file else "warning")
    config = Config(**{name: getattr(args, name) for name in CONFIG_FLAGS if name in args})
    config.enable_lora, config.lora_modules = bool(args.adapters), args.adapters
    model_dir = resolve_model(config.model, config.cache_dir)
    if config.enable_lora:  # refused here, as `cadence serve` refuses them, before any run
        registry_at_start(model_dir, config.max_lora_rank, config.lora_modules)
    tokenizer = Tokenizer.from_dir(model_dir)
    maker = PromptMaker(codec_from_tokenizer_json(model_dir / "tokenizer.json"))
    rng = random.Random(args.seed)
    offsets = maker.distinct_offsets(rng, args.num_requests)
    prompts = [tokenizer.encode(maker.make(args.prompt_len, o)) for o in offsets]
    cap = args.max_batched_tokens or max(2048, args.num_requests * args.prompt_len)
    runs = []
    overlaps = {"both": ["off", "on"]}.get(args.overlap, [args.overlap])
    for policy, overlap in itertools.product(args.policy or ["fcfs", "stall_free"], overlaps):
        run_config = dataclasses.replace(
            config,
            policy=policy,
            overlap=overlap,
            max_batched_tokens=cap,
            max_num_seqs=max(128, args.num_requests),
            max_queue=max(config.max_queue, args.num_requests),
            max_queued_tokens=max(config.max_queued_tokens, sum(map(len, prompts))),
        )
        runs.append(
            trio.run(run_policy, run_config, model_dir, tokenizer, prompts, args.output_len)
        )
    print(
        f"{args.num_requests} requests, prompt {args.prompt_len}, output {args.output_len}, "
        f"{config.dtype}, {config.kv_cache_dtype} KV cache, max_batched_tokens {cap}, "
        f"{len(args.adapters)} LoRA adapters"
    )
    print_report([summarize(r) for r in runs], runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
