"""The device check's promise: cadence's headline scenario and its capacity, measured on the
real service where most users would serve it.

`interference`: streams decoding while long prompts arrive one after the other (on a GPU
16 streams, an 8k- and a 32k-token prompt), once under `fcfs` and once under `stall_free`,
the policy swapped through the admin API on the same server. Per policy: the streams'
worst gap while a prompt is absorbed, their ITL p99 and p50, a decode step (the streams'
median gap away from the prompts, on the client's clock as the worst gap is; and the
worker's own, from the server's iteration log), the worst gap over that step, and each
prompt's TTFT. The issue's bar (BAR): under `stall_free`, a worst gap of at most 2x a
decode step while the longest prompt is absorbed; reported (`meets_bar`), not a failure:
the section fails only when the scenario did not run soundly (a prompt unanswered, a stream
ended before a prompt was absorbed).

`capacity`: a short sweep of `cadence bench capacity`'s mixed workload (chat turns with
long-tailed lengths, a share of long documents, Poisson arrivals) at three rates under
`stall_free`, with the SLO attainment at each rate and the capacity the sweep finds.

Both run on the service ops.device_serve keeps in their process (the timing model: the 1B
Llama widths on a GPU, the tiny one with --quick; a word-level tokenizer), installed from
--wheels like serve_http's and skipped as it is without them. Their load (how large, and
how it is driven) is ops.device_load's, imported once the service's dependencies are
there: it needs trio and httpx, which a GPU host may lack until a section installs them.
"""

from __future__ import annotations

from typing import Any

from ops.device_sections import QUICK, Context
from ops.device_serve import Server, on_service

BAR = 2.0  # the issue's: stall_free's worst gap over a decode step, the longest prompt's


def interference(ctx: Context) -> dict[str, Any]:
    return on_service(ctx, lambda server: _interference(ctx, server))


def capacity(ctx: Context) -> dict[str, Any]:
    return on_service(ctx, lambda server: _capacity(ctx, server))


def _interference(ctx: Context, server: Server) -> dict[str, Any]:
    from ops import device_load  # imports trio and httpx: on_service made them importable

    quick = ctx.profile is QUICK
    load = device_load.QUICK_INTERFERENCE if quick else device_load.FULL_INTERFERENCE
    policies, prompts = device_load.interference(server, load, _vocab(ctx))
    longest = [row for row in prompts if row["policy"] == "stall_free"][-1]
    ratio = longest["gap_max_over_step"]
    answered = all(
        row["ttft_ms"] is not None and row["streams_active"] == load.streams for row in prompts
    )
    return {
        "streams": load.streams,
        "prompts": " ".join(map(str, load.prompts)),
        "stall_free_gap_over_step": ratio,  # while the longest prompt is absorbed
        "bar": BAR,
        "meets_bar": ratio is not None and ratio <= BAR,
        "policies": policies,
        "prompt_rows": prompts,
        "ok": answered,
    }


def _capacity(ctx: Context, server: Server) -> dict[str, Any]:
    from ops import device_load  # imports trio and httpx: on_service made them importable

    load = device_load.QUICK_CAPACITY if ctx.profile is QUICK else device_load.FULL_CAPACITY
    context = ctx.profile.timing_model["max_position_embeddings"]
    rates, found = device_load.capacity(server, load, _vocab(ctx), context)
    return {
        "policy": "stall_free",
        "ttft_ms": load.ttft_ms,
        "itl_p99_ms": load.itl_p99_ms,
        "attainment": load.attainment,
        **found,
        "rates": rates,
        "ok": len(rates) == len(load.rates) and all(row["failed"] == 0 for row in rates),
    }


def _vocab(ctx: Context) -> int:
    return ctx.profile.timing_model["vocab_size"]
