"""`cadence bench speculation`: one stream at a time on tasks whose answers repeat their
input, and on free text; its tokens/s, and the drafts the server accepted.

    cadence bench speculation --url URL [--task edit|quote|free|all] [--requests 4]
        [--max-tokens 256]

Each request is a chat completion at temperature 0 that may stop at its end of sequence
(so a server with and without speculation answers the same tokens). Tasks:
- edit: rewrite a piece of code with a name changed (the answer is mostly the code again);
- quote: summarise a passage, quoting it (the answer copies spans of it);
- free: a story from a one-line prompt (nothing to copy: n-gram drafts rarely match).
Requests go one after another, so each stream has the server alone. Prints, per task, the
output tokens/s (completion tokens over the time from first to last token, summed), TPOT
and ITL p50 (chunk gaps: a step that accepts drafts sends its tokens in one chunk), and
the acceptance rate from the server's /metrics counters (cadence's; "-" for a server that
has none). Writes speculation.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import httpx
import orjson
import trio

from ops.bench import add_client_args, client_config, default_out_dir, jsonable_args
from ops.client import (
    ClientConfig,
    RequestRecord,
    RequestSpec,
    api_root,
    auth_headers,
    discover_model,
    new_record,
    open_client,
    send_chat,
)
from ops.corpus import PASSAGES
from ops.summary import format_table, gaps, percentile, tpot
from ops.tool_main import run_tool

PROG = "cadence bench speculation"
TASKS = ("edit", "quote", "free")
DRAFTED = "cadence:spec_decode_num_draft_tokens_total"
ACCEPTED = "cadence:spec_decode_num_accepted_tokens_total"

CODE = [
    '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for index in range(window, len(values)):
        total += values[index] - values[index - window]
        averages.append(total / window)
    return averages''',
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())""",
    """def merge_sorted(first, second):
    merged = []
    i = j = 0
    while i < len(first) and j < len(second):
        if first[i] <= second[j]:
            merged.append(first[i])
            i += 1
        else:
            merged.append(second[j])
            j += 1
    merged.extend(first[i:])
    merged.extend(second[j:])
    return merged""",
]
RENAMES = [("values", "samples"), ("items", "stock"), ("merged", "result")]
STORIES = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a day in the life of a baker in a small mountain village.",
    "Tell a story about a robot that learns to paint.",
    "Write about two friends who get lost on a hiking trip and what they learn.",
]


@dataclasses.dataclass(slots=True)
class TaskResult:
    task: str
    records: list[RequestRecord]
    drafted: float | None  # draft tokens the server verified during the task
    accepted: float | None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=(*TASKS, "all"), default="all")
    parser.add_argument("--requests", type=int, default=4, help="requests per task")
    parser.add_argument("--max-tokens", type=int, default=256, help="answer tokens at most")
    add_client_args(parser, slo=False)
    return parser


def task_messages(task: str, index: int) -> list[dict[str, str]]:
    """The chat of request `index` of `task`."""
    if task == "edit":
        code = CODE[index % len(CODE)]
        old, new = RENAMES[index % len(RENAMES)]
        text = f"Rename `{old}` to `{new}` in this code and show the whole code:\n\n{code}"
    elif task == "quote":
        passage = PASSAGES[index % len(PASSAGES)][:1500]
        text = f"Summarise this passage, quoting its key sentences word for word:\n\n{passage}"
    else:
        text = STORIES[index % len(STORIES)]
    return [{"role": "user", "content": text}]


async def spec_counters(client: httpx.AsyncClient, config: ClientConfig) -> dict[str, float]:
    """cadence's speculation counters from /metrics; empty where the server has none."""
    root = api_root(config.base_url).removesuffix("/v1")
    try:
        response = await client.get(f"{root}/metrics", headers=auth_headers(config.api_key))
    except httpx.HTTPError:
        return {}
    found = {}
    for name in (DRAFTED, ACCEPTED):
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", response.text, re.M)
        if match:
            found[name] = float(match.group(1))
    return found


async def measure(args: argparse.Namespace) -> list[TaskResult]:
    model = args.model or await discover_model(args.url, args.api_key)
    config = dataclasses.replace(client_config(args.url, model, args), ignore_eos=False)
    tasks = TASKS if args.task == "all" else (args.task,)
    results = []
    async with open_client(config) as client:
        t0 = trio.current_time()
        for task in tasks:
            before = await spec_counters(client, config)
            records = []
            for index in range(args.requests):
                spec = RequestSpec(index, 0.0, "", 0, args.max_tokens, role=task)
                record = new_record(spec)
                messages = task_messages(task, index)
                await send_chat(client, config, messages, args.max_tokens, record, t0)
                records.append(record)
            after = await spec_counters(client, config)
            drafted, accepted = (
                after[name] - before[name] if name in after and name in before else None
                for name in (DRAFTED, ACCEPTED)
            )
            results.append(TaskResult(task, records, drafted, accepted))
    return results


def decode_rate(records: list[RequestRecord]) -> float | None:
    """Output tokens after the first over the time from first to last token, summed."""
    tokens = sum(max(0, r.output_tokens - 1) for r in records if r.ok)
    seconds = sum(
        r.end_s - r.first_token_s
        for r in records
        if r.ok and r.end_s is not None and r.first_token_s is not None
    )
    return tokens / seconds if seconds > 0 else None


def report(results: list[TaskResult]) -> str:
    rows = []
    for result in results:
        ok = [r for r in result.records if r.ok]
        tpot_p50 = percentile([t for t in (tpot(r) for r in ok) if t is not None], 50)
        itl = percentile([g for r in ok for g in gaps(r)], 50)
        rate = None
        if result.drafted:
            rate = f"{(result.accepted or 0) / result.drafted:.1%}"
        rows.append(
            [
                result.task,
                f"{len(ok)}/{len(result.records)}",
                sum(r.output_tokens for r in ok),
                decode_rate(ok),
                None if tpot_p50 is None else tpot_p50 * 1000,
                None if itl is None else itl * 1000,
                "-" if result.drafted is None else int(result.drafted),
                rate or "-",
            ]
        )
    header = [
        "task",
        "ok",
        "tokens",
        "tokens/s",
        "TPOT p50 ms",
        "ITL p50 ms",
        "drafted",
        "accepted",
    ]
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    return run_tool(PROG, build_parser(), argv, measured, write_report)


def measured(args: argparse.Namespace) -> list[TaskResult]:
    if args.requests < 1 or args.max_tokens < 1:
        raise ValueError("--requests and --max-tokens must be >= 1")
    return trio.run(measure, args)


def write_report(args: argparse.Namespace, results: list[TaskResult]) -> int:
    out_dir: Path = args.out or default_out_dir("speculation")
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "args": jsonable_args(args),
        "tasks": [dataclasses.asdict(r) for r in results],
    }
    path = out_dir / "speculation.json"
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    print(f"{PROG} against {args.url}\n\n{report(results)}\n\nwrote {path}")
    return 0 if all(r.ok for result in results for r in result.records) else 1
