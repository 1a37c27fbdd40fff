"""The device check's speed sections: the flex probes, and the decode timings with where a
decode step's time goes; and the timing tools both use.

Timing. A probe's time is the mean of `timed_calls` back-to-back calls (100 on a GPU),
between two CUDA events, after the GPU was warmed (about 200 ms of matmuls, its clocks up
from idle), and again from the same call captured in a CUDA graph and replayed as many
times: the eager figure carries the launches, the graph's only the kernels. One call
timed between syncs would time the launch and the sync instead (the first H200 run's
batch 1 came out slower than its batch 64). On a CPU the same code times with
perf_counter and "captures" nothing (the graph figure is the eager call's again), so that
`--device cpu --quick` runs every line of it.

flex_probes: FlexAttention (gpu_worker.attention), compiled as the worker compiles it, on
the shapes where Inductor's choices break it or slow it.
- short chunks: a prefill chunk of each short length class (2-127 tokens) at each GQA
  group size a model has (1, 2, 4, 8 query heads per KV head), against TorchAttention: the
  lengths where Inductor's flex-decoding lowering found no valid config;
- decode kernels: the CUDA kernels one decode call runs at batch 1 and 64 (torch.profiler),
  whether Inductor's flex-decoding template is among them, and the call's time, eager and
  from a graph, beside the floor of reading its KV once; cadence's own Triton decode kernel
  on the same rows, timed alike, and its difference from the reference. Template kernels
  are named by the graph's operator (`triton_tem_fused_flex_attention_N` for either
  template), so the template is told by its source: only flex-decoding's defines SPLIT_KV;
- graph replay: the batch-64 decode captured in a CUDA graph, replayed on new queries,
  equal to the same call run eagerly.
On a CPU FlexAttention runs eagerly (nothing is compiled): the probes run as a check of
the script, the kernel names are the CPU's operators, and there is no graph to replay.

decode_timings: median step times of a 1B-class model (ops.device_sections' FULL
profile) as served, each beside its roofline: the larger of the time its bytes take at
the measured copy bandwidth and the time its flops take at the measured matmul rate (the
`machine` section's; the nominal figures when that section has not run). The mixed row
also stands beside the roofline of the token bucket its graphs are padded to. Then, on
the same warm worker, where a decode step's time goes:
- decode_profile: one decode step at batch 1 and 64 under torch.profiler (its CUDA
  kernels, copies and fills; on a CPU its operators, each by its own time): their count,
  µs by class (KERNEL_CLASSES), the busy µs (their sum) and the span (first start to last
  end, under the profiler's overhead) beside the step's wall unprofiled (its row's
  median); top_kernels names the costliest;
- host_before_replay: the host's µs before the replay: `runner.inputs(plan)` (the plan
  applied to the table, the step's facts), the decode tensors, and runner.logits until the
  replay is queued;
- floors: the model's matmuls alone (every layer's and the LM head, at the batch's rows,
  in one captured graph): one library call per weight, and as the worker calls them (its
  checked row sizes, gpu_worker.linear); and F.scaled_dot_product_attention decoding every
  layer's KV, contiguous, of the same shapes: what this machine attains, beside the bytes'
  floors;
- mixed_profile: the mixed row's step split the same way (its kernels and busy µs against
  its span and its step: the GPU's waits between the pieces);
- kernel_trials: every candidate the worker's kernel chooser timed, and its pick;
  row_sizes: the matmul call sizes the worker checked and kept (those that agree bit for
  bit on this device).
"""

from __future__ import annotations

import ast
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from gpu_worker.attention import FlexAttention, TorchAttention, flex_backend, metadata_for
from gpu_worker.buckets import smallest_fitting
from gpu_worker.kernel_choice import TOLERANCE, AttentionCase, Shapes, attention_case, run_prefill
from gpu_worker.linear import SizedCalls, checked_sizes
from gpu_worker.model import Model
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import StepPlan
from gpu_worker.runner import ModelRunner
from gpu_worker.staging import gather_tables
from ops.device_report import say
from ops.device_sections import Context, Profile, figures
from ops.roofline import Machine, ModelCost, step_times
from ops.worker_steps import Blocks, Seq, Steps, tokens_of

T = TypeVar("T")

SHORT_CHUNKS = (2, 3, 17, 33, 64, 100, 127)  # each class of short length, both ends
GROUPS = (1, 2, 4, 8)
KV_HEADS, HEAD_DIM = 2, 64
CHUNK_START = 70  # a cached prefix before the chunk, ending mid-block
DECODE_HEADS, DECODE_KV_HEADS = 32, 8  # Llama-3.2-1B's
DECODE_BATCHES = (1, 64)
CPU_DECODE_BATCHES = (1, 4)  # eager FlexAttention is dense over the whole cache
WARM_S = 0.2  # of matmuls before the first timed probe, on a GPU
TOP_KERNELS = 8  # per profiled step


# ---- timing tools ---------------------------------------------------------------------------


def warm_up_device(device: torch.device) -> None:
    """About WARM_S seconds of square matmuls: a GPU idle between sections runs its first
    kernels at low clocks. On a CPU a moment of small ones (the code path, no more)."""
    cuda = device.type == "cuda"
    size, seconds = (4096, WARM_S) if cuda else (64, WARM_S / 20)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            a @ a
        _sync(device)


def elapsed_s(run: Callable[[], object], device: torch.device) -> float:
    """The seconds `run`'s work takes: between CUDA events recorded around it on a GPU
    (what it queued, not the host's time to queue it), perf_counter on a CPU."""
    if device.type != "cuda":
        started = time.perf_counter()
        run()
        return time.perf_counter() - started
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000


def time_calls(call: Callable[[], object], device: torch.device, calls: int) -> float:
    """µs per call over `calls` calls back to back (nothing waits between them), after one
    call that compiles or allocates what a first call does."""
    call()

    def run() -> None:
        for _ in range(calls):
            call()

    return elapsed_s(run, device) / calls * 1e6


def captured(call: Callable[[], T], device: torch.device) -> Callable[[], T]:
    """`call` captured in a CUDA graph: its replay, returning the captured output (which
    each replay rewrites). Warmed twice on a side stream first, as capture requires. On a
    CPU `call` itself: there are no graphs to capture there."""
    if device.type != "cuda":
        return call
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        call()
        call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = call()

    def replay() -> T:
        graph.replay()
        return output

    return replay


def timed(name: str, call: Callable[[], object], device: torch.device, calls: int) -> dict:
    """{name}_us: `calls` eager calls back to back; and replayed()'s."""
    eager = {f"{name}_us": round(time_calls(call, device, calls), 1)}
    return eager | replayed(name, call, device, calls)


def replayed(
    name: str, call: Callable[[], object], device: torch.device, calls: int
) -> dict[str, Any]:
    """{name}_graph_us: µs per replay of `call` captured, over `calls` replays back to back
    (on a CPU, eager calls again); or {name}_graph_error where it could not be captured."""
    try:
        replay = captured(call, device)
    except RuntimeError as exc:  # a kernel that syncs or allocates on the host while captured
        return {f"{name}_graph_error": _last_line(exc)}
    return {f"{name}_graph_us": round(time_calls(replay, device, calls), 1)}


def best_us(row: dict[str, Any], name: str) -> float:
    """A timed() row's better figure: the graph's where it was captured."""
    graph = row.get(f"{name}_graph_us")
    return min(row[f"{name}_us"], graph) if isinstance(graph, float) else row[f"{name}_us"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- flex probes ----------------------------------------------------------------------------


def flex_probes(ctx: Context) -> dict[str, Any]:
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    context = 1024 if ctx.cuda else 64
    warm_up_device(torch.device(ctx.device))
    chunks = [short_chunk(ctx, group, count, dtype) for group in GROUPS for count in SHORT_CHUNKS]
    batches = DECODE_BATCHES if ctx.cuda else CPU_DECODE_BATCHES
    decodes = [decode_kernels(ctx, batch, context, dtype) for batch in batches]
    replay = graph_replay(ctx, context, dtype)
    return {
        "short_chunks": chunks,
        "decode": decodes,
        "graph_replay": replay,
        "compile_count": flex_backend.compile_count(),
        "ok": all(row["ok"] for row in [*chunks, *decodes, replay]),
    }


def _shapes(ctx: Context, heads: int, kv_heads: int, dtype: torch.dtype) -> Shapes:
    device = torch.device(ctx.device)
    return Shapes(heads, kv_heads, HEAD_DIM, 256, 512, ctx.block_size, dtype, device, dtype)


def short_chunk(ctx: Context, group: int, count: int, dtype: torch.dtype) -> dict[str, Any]:
    case = attention_case(_shapes(ctx, KV_HEADS * group, KV_HEADS, dtype), 1, count, CHUNK_START)
    row: dict[str, Any] = {"group": group, "chunk": count}
    try:
        got = run_prefill(FlexAttention(), case)
    except Exception as exc:  # NoValidChoicesError, as Inductor raised it before the fix
        row |= {"ok": False, "error": _last_line(exc)}
    else:
        diff = (got.float() - run_prefill(TorchAttention(), case).float()).abs().max().item()
        row |= {"max_abs_diff": round(diff, 5), "ok": diff < TOLERANCE[dtype]}
    say(f"short chunk: {row}")
    return row


def decode_kernels(ctx: Context, batch: int, context: int, dtype: torch.dtype) -> dict[str, Any]:
    case = attention_case(_shapes(ctx, DECODE_HEADS, DECODE_KV_HEADS, dtype), batch, 16, context)
    call = decode_call(FlexAttention(), case)
    sources = compiled_during(call)
    template = None if not ctx.cuda or not sources else "SPLIT_KV" in sources
    device = torch.device(ctx.device)
    times = timed("flex", call, device, ctx.profile.timed_calls)
    kv_bytes = sum(case.lens) * 2 * DECODE_KV_HEADS * HEAD_DIM * dtype.itemsize
    floor_us = kv_bytes / ctx.machine()[0].bandwidth * 1e6
    row = {
        "batch": batch,
        "context_tokens": sum(case.lens),
        "kernels": ", ".join(kernel_names(call, device)),
        "decoding_template": template,
        **times,
        "kv_floor_us": round(floor_us, 2),
        "floor_ratio": round(floor_us / best_us(times, "flex"), 3),
        "ok": template is not False,  # unknown where nothing was compiled
    }
    if ctx.cuda:
        row |= triton_decode(case, dtype, template is not False, ctx.profile.timed_calls)
    say(f"decode: {row}")
    return row


def triton_decode(case: AttentionCase, dtype: torch.dtype, ok: bool, calls: int) -> dict[str, Any]:
    """cadence's own Triton decode kernel (gpu_worker.attention.triton_backend) on the same
    rows: its time, eager and from a graph, and its largest difference from the reference."""
    try:
        from gpu_worker.attention.triton_backend import TritonAttention
    except ImportError:
        return {}
    call = decode_call(TritonAttention(), case)
    try:
        got = call()
    except Exception as exc:
        return {"triton_error": _last_line(exc), "ok": False}
    diff = (got.float() - decode_call(TorchAttention(), case)().float()).abs().max().item()
    return {
        **timed("triton", call, case.kv.k.device, calls),
        "triton_max_abs_diff": round(diff, 5),
        "ok": ok and diff < TOLERANCE[dtype],
    }


def graph_replay(ctx: Context, context: int, dtype: torch.dtype) -> dict[str, Any]:
    if not ctx.cuda:
        return {"ran": "no: CUDA graphs need CUDA", "ok": True}
    batch = DECODE_BATCHES[-1]
    case = attention_case(_shapes(ctx, DECODE_HEADS, DECODE_KV_HEADS, dtype), batch, 16, context)
    call = decode_call(FlexAttention(), case)
    replay = captured(call, torch.device(ctx.device))
    case.q_decode.copy_(torch.randn_like(case.q_decode))  # the graph reads its queries anew
    replayed = replay()
    eager = call()
    reference = decode_call(TorchAttention(), case)()
    torch.cuda.synchronize()
    diff = (replayed.float() - reference.float()).abs().max().item()
    equal = torch.equal(replayed, eager)
    found = {"batch": batch, "replay_equals_eager": equal, "max_abs_diff_vs_torch": round(diff, 5)}
    found["ok"] = equal and diff < TOLERANCE[dtype]
    say(f"graph replay: {found}")
    return found


def decode_call(backend: Any, case: AttentionCase) -> Callable[[], torch.Tensor]:
    """The decode attention of every row of `case`, its metadata built once."""
    rows, device = len(case.lens), case.kv.k.device
    meta = metadata_for(
        [1] * rows,
        [n - 1 for n in case.lens],
        case.tables,
        torch.zeros(rows, dtype=torch.long, device=device),
        case.kv.k,
        case.group_size,
        backend,
        case.layer,
    )
    group = meta.decode
    assert group is not None
    return lambda: backend.decode(case.q_decode, case.kv, group)


def compiled_during(call: Callable[[], Any]) -> str | None:
    """Runs `call`; the source of the Inductor modules loaded meanwhile (compiled, or read
    from Inductor's cache), "" if none was, None where this torch does not list them."""
    try:
        from torch._inductor.codecache import PyCodeCache

        modules = PyCodeCache.modules
    except (ImportError, AttributeError):
        modules = None
    if not isinstance(modules, list):
        call()
        return None
    before = len(modules)
    call()
    texts = []
    for module in modules[before:]:
        try:
            texts.append(Path(module.__file__ or "").read_text())
        except (OSError, TypeError):
            continue
    return "\n".join(texts)


def kernel_names(call: Callable[[], Any], device: torch.device) -> list[str]:
    """The device kernels one `call` launches (on a CPU, the operators it runs)."""
    names = sorted({kernel.name for kernel in profiled_kernels(call, device)})
    return names if device.type == "cuda" else [n for n in names if n.startswith("aten::")][:8]


# ---- kernels under the profiler -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    start_us: float
    end_us: float
    us: float  # its own time: a GPU kernel's duration, a CPU operator's time less its callees'


def profiled_kernels(call: Callable[[], Any], device: torch.device) -> list[Kernel]:
    """What one `call` ran under torch.profiler: the GPU's kernels, copies and fills on
    CUDA; on a CPU, its operators (nested: each with its own time)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        call()
        _sync(device)
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    return [
        Kernel(
            event.name,
            event.time_range.start,
            event.time_range.end,
            event.time_range.elapsed_us() if cuda else event.self_cpu_time_total,
        )
        for event in prof.events()
        if event.device_type == kind
    ]


# Classes of kernels by marks in their names (lower case), the first class that matches:
# attention before GEMM, since cuDNN's and FlashAttention-3's attention kernels carry "sm90".
ATTENTION_MARKS = "_partition _merge decode attention attn flash sdpa fmha scaled_dot_product"
# cuBLAS on Hopper with CUDA 12.8 and later names many of its GEMMs nvjet_*, and its M=1
# calls may be GEMVs.
GEMM_MARKS = "gemm gemv nvjet cutlass cublas matmul sm90 addmm aten::mm linear"
# elementwise, reductions and indexing: the layer ops' and the sampler's kernels
ELEMENTWISE_MARKS = (
    "elementwise reduce index gather scatter copy fill cat norm rope silu softmax sort topk "
    "scan embedding triton_poi triton_per triton_red aten::add aten::mul"
)
KERNEL_CLASSES = (
    ("memcpy", ("memcpy", "memset")),
    ("attention", tuple(ATTENTION_MARKS.split())),
    ("gemm", tuple(GEMM_MARKS.split())),
    ("elementwise", tuple(ELEMENTWISE_MARKS.split())),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for found, marks in KERNEL_CLASSES:
        if any(mark in lowered for mark in marks):
            return found
    return "other"


def kernel_split(kernels: list[Kernel]) -> dict[str, Any]:
    """Their count, µs by class, and the busy µs (their sum) beside the span (first start
    to last end): where the span exceeds the sum, the GPU waited on the host."""
    split: dict[str, Any] = {"kernels": len(kernels)}
    for name, _ in (*KERNEL_CLASSES, ("other", ())):
        us = sum(k.us for k in kernels if kernel_class(k.name) == name)
        split[f"{name}_us"] = round(us, 1)
    split["busy_us"] = round(sum(k.us for k in kernels), 1)
    span = max(k.end_us for k in kernels) - min(k.start_us for k in kernels) if kernels else 0
    split["span_us"] = round(span, 1)
    return split


def top_kernels(kernels: list[Kernel], count: int = TOP_KERNELS) -> list[dict[str, Any]]:
    """The names that took the most µs: their class, calls and µs."""
    by_name: dict[str, list[Kernel]] = {}
    for kernel in kernels:
        by_name.setdefault(kernel.name, []).append(kernel)
    totals = sorted(
        ((sum(k.us for k in calls), name) for name, calls in by_name.items()), reverse=True
    )
    return [
        {
            "class": kernel_class(name),
            "calls": len(by_name[name]),
            "us": round(us, 1),
            "kernel": name[:100],
        }
        for us, name in totals[:count]
    ]


# ---- decode timings -------------------------------------------------------------------------


def decode_timings(ctx: Context) -> dict[str, Any]:
    """Step times of the timing model at kv_memory=0.9, each beside its roofline, and
    where a decode step's time goes."""
    profile = ctx.profile
    runner = ctx.runner(
        "llama",
        ctx.serving_dtype,
        timing=True,
        kv_memory=0.9,
        max_num_seqs=max(profile.decode_batches),
        max_num_batched_tokens=2048,
    )
    machine, source = ctx.machine()
    say(f"rooflines at the {source} {machine.bandwidth / 1e9:.0f} GB/s, "
        f"{machine.matmul_flops / 1e12:.0f} TFLOP/s")  # fmt: skip
    warm_up_device(runner.model.device)
    timer = StepTimer(runner, machine, profile.repeats)
    rows = [timer.decode(batch, profile.context) for batch in profile.decode_batches]
    rows.append(timer.mixed(profile.chunk, profile.mixed_decoders, profile.context))
    rows += [timer.decode(batch, profile.long_context) for batch in profile.long_batches]
    config, handshake = runner.model.config, runner.handshake
    assert handshake is not None
    kernels = handshake.kernels
    found = {
        "model": {
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "dtype": ctx.serving_dtype,
            "block_size": runner.cache.block_size,
        },
        "roofline_figures": source,
        "kernels": {k: v for k, v in kernels.items() if k != "measured"},
        "startup_s": handshake.startup,
        "rows": rows,
        "kv_memory": _kv_memory(runner),
    }
    return (
        found
        | where_the_time_goes(timer, profile.profiled_batches, profile)
        | {"mixed_profile": [mixed_profile(timer, profile)]}
        | {
            "kernel_trials": kernel_trials(kernels),
            "row_sizes": row_sizes(),
            "compile_count": flex_backend.compile_count(),
            "ok": True,
        }
    )


def where_the_time_goes(
    timer: StepTimer, batches: tuple[int, ...], profile: Profile
) -> dict[str, list[dict[str, Any]]]:
    """decode_profile, top_kernels, host_before_replay and floors, at each of `batches`."""
    found: dict[str, list[dict[str, Any]]] = {
        "decode_profile": [],
        "top_kernels": [],
        "host_before_replay": [],
        "floors": [],
    }
    for batch in batches:
        plan = timer.steady_plan(timer.decode_seqs(batch, profile.context))
        step_us = timer.decode_ms[(batch, profile.context)] * 1000  # its row's median
        kernels = profiled_kernels(partial(timer.runner.execute, plan), timer.device)
        split = kernel_split(kernels)
        busy_share = round(split["busy_us"] / step_us, 3)
        found["decode_profile"].append(
            {"batch": batch, "context": profile.context, **split, "step_us": round(step_us, 1)}
            | {"busy_share_of_step": busy_share}
        )
        found["top_kernels"] += [{"batch": batch, **row} for row in top_kernels(kernels)]
        found["host_before_replay"].append({"batch": batch, **timer.host_us(plan)})
        found["floors"].append(timer.floors(batch, profile.context, profile.timed_calls))
        say(f"batch {batch}: {found['decode_profile'][-1]}")
        say(f"batch {batch}: {found['host_before_replay'][-1]}; {found['floors'][-1]}")
    return found


def mixed_profile(timer: StepTimer, profile: Profile) -> dict[str, Any]:
    """The mixed row's step under torch.profiler, split as decode_profile: where the span
    exceeds the busy µs, the GPU waited on the host between the pieces (issue 52)."""
    seqs = timer.mixed_seqs(profile.chunk, profile.mixed_decoders, profile.context)
    plan = timer.steady_plan(seqs)
    split = kernel_split(profiled_kernels(partial(timer.runner.execute, plan), timer.device))
    step_us = timer.mixed_ms * 1000
    found = {"chunk": profile.chunk, "decoders": profile.mixed_decoders, **split}
    found |= {
        "step_us": round(step_us, 1),
        "busy_share_of_step": round(split["busy_us"] / step_us, 3),
    }
    say(f"mixed: {found}")
    return found


class StepTimer:
    """Times steps of one runner, each row beside its roofline on `machine`, and takes
    decode steps apart."""

    def __init__(self, runner: ModelRunner, machine: Machine, repeats: int) -> None:
        self.runner = runner
        self.machine = machine
        self.repeats = repeats
        self.cost = ModelCost.of(runner.model.config, runner.model.dtype.itemsize)
        self.block_size = runner.cache.block_size
        self.device = runner.model.device
        self.decode_ms: dict[tuple[int, int], float] = {}  # by (batch, context): the rows'
        self.mixed_ms = 0.0  # the mixed row's

    def decode_seqs(self, batch: int, context: int) -> list[Seq]:
        blocks = Blocks(self.block_size)
        return [Seq(i, [5], context - 1, blocks.take(context)) for i in range(batch)]

    def decode(self, batch: int, context: int) -> dict[str, Any]:
        ms = self.time_plan(self.steady_plan(self.decode_seqs(batch, context)))
        self.decode_ms[(batch, context)] = ms
        pairs = batch * context
        return timing_row(
            f"decode, batch {batch}, context {context}", ms, self.cost, self.machine,
            tokens=batch, kv_tokens=pairs, attention_pairs=pairs, decoded=batch,
        )  # fmt: skip

    def mixed_seqs(self, chunk: int, decoders: int, context: int) -> list[Seq]:
        """A `chunk`-token prompt chunk (sampling nothing) beside `decoders` decode rows."""
        blocks = Blocks(self.block_size)
        vocab = self.runner.model.config.vocab_size
        prefilled = Seq(0, tokens_of(chunk, 6, vocab), 0, blocks.take(chunk), False)
        rows = [Seq(1 + i, [5], context - 1, blocks.take(context)) for i in range(decoders)]
        return [prefilled, *rows]

    def mixed(self, chunk: int, decoders: int, context: int) -> dict[str, Any]:
        ms = self.time_plan(self.steady_plan(self.mixed_seqs(chunk, decoders, context)))
        self.mixed_ms = ms
        tokens = chunk + decoders
        kv_tokens = chunk + decoders * context
        pairs = chunk * (chunk + 1) // 2 + decoders * context
        row = timing_row(
            f"mixed: a {chunk}-token chunk + {decoders} decodes at {context}",
            ms, self.cost, self.machine,
            tokens=tokens, kv_tokens=kv_tokens, attention_pairs=pairs, decoded=decoders,
        )  # fmt: skip
        bucket = mixed_bucket(self.runner, tokens)
        row |= {"tokens": tokens, "bucket_tokens": bucket or "eager"}
        if bucket is not None:  # its graphs' matmuls run over every padded row
            row |= {"captured": "whole" if self.runner.mixed.whole else "pieces"}
            memory_s, compute_s = step_times(self.cost, self.machine, bucket, kv_tokens, pairs)
            bucket_ms = max(memory_s, compute_s) * 1000
            row |= {"bucket_roofline_ms": figures(bucket_ms)}
            row |= {"bucket_roofline_ratio": figures(bucket_ms / ms)}
        return row

    def steady_plan(self, seqs: list[Seq]) -> StepPlan:
        """The plan of `seqs` as served: the sequences introduced by a first plan (run
        here), so that this one carries no tables (a chunk from position 0 starts a
        sequence each time, as a new prompt does)."""
        steps = Steps(self.runner.limits.num_groups)
        self.runner.execute(steps.plan(seqs))
        return steps.plan(seqs)

    def time_plan(self, plan: StepPlan) -> float:
        """The median ms of the step of `plan`, after two warm-ups, wall clock to the end
        of its work."""
        times = []
        for i in range(self.repeats + 2):
            _sync(self.device)
            started = time.perf_counter()
            result = self.runner.execute(plan)
            _sync(self.device)
            if result.error is not None:
                raise RuntimeError(result.error)
            if i >= 2:
                times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)

    def host_us(self, plan: StepPlan) -> dict[str, float]:
        """Median host µs of a decode step's parts before its replay, each part run as
        the runner runs it: runner.inputs(plan); the step's integers staged and sent and
        its tables gathered at the shape the decode runner runs it at (gpu_worker.staging);
        and runner.logits until the replay is queued (the staging again, into the graph's
        inputs, and the launch)."""
        runner = self.runner
        decode = runner.decode_runner
        parts: dict[str, list[float]] = {"inputs": [], "staging": [], "launch": []}
        for _ in range(self.repeats):
            _sync(self.device)
            started = time.perf_counter()
            inputs = runner.inputs(plan)
            applied = time.perf_counter()
            batch, width = decode.shape(inputs)
            staged = decode.staging.send(decode.staging.stage(inputs, batch))
            gather_tables(inputs.held_tables, staged[2], width)
            prepared = time.perf_counter()
            runner.logits(inputs)
            launched = time.perf_counter()
            _sync(self.device)
            parts["inputs"].append(applied - started)
            parts["staging"].append(prepared - applied)
            parts["launch"].append(launched - prepared)
        return {f"{name}_us": round(statistics.median(s) * 1e6, 1) for name, s in parts.items()}

    def floors(self, batch: int, context: int, calls: int) -> dict[str, Any]:
        """What the machine attains for the step's matmuls and attention alone (captured
        graphs, timed_calls replays), beside their bytes' floors."""
        model, bandwidth = self.runner.model, self.machine.bandwidth
        weights = model_matmuls(model)
        kv_bytes = batch * context * self.cost.kv_bytes_per_token
        device = self.device
        return {
            "batch": batch,
            "context": context,
            **replayed("gemm", matmul_pass(weights, batch, model, served=False), device, calls),
            **replayed("gemm_as_served", matmul_pass(weights, batch, model), device, calls),
            "weight_floor_us": figures(self.cost.weight_bytes / bandwidth * 1e6),
            **replayed("sdpa", sdpa_pass(model, batch, context), device, calls),
            "kv_floor_us": figures(kv_bytes / bandwidth * 1e6),
        }


def mixed_bucket(runner: ModelRunner, tokens: int) -> int | None:
    """The token bucket whose captured graphs a mixed step of `tokens` replays
    (gpu_worker.mixed_graphs); None when it runs eagerly (no graphs: a CPU)."""
    assert runner.handshake is not None
    captured_buckets = runner.handshake.graphs.get("mixed", {}).get("buckets", [])
    bucket = smallest_fitting(tokens, runner.mixed.buckets) if runner.mixed else None
    return bucket if bucket in captured_buckets else None


def model_matmuls(model: Model) -> list[tuple[SizedCalls, int]]:
    """Every matmul of a decode step (each layer's, then the LM head's), with its input
    width."""
    cfg: ModelConfig = model.config
    q_width = cfg.num_attention_heads * cfg.head_dim
    found: list[tuple[SizedCalls, int]] = []
    for layer in model.layers:
        pairs = (
            (layer.qkv, cfg.hidden_size),
            (layer.o_proj, q_width),
            (layer.gate_up, cfg.hidden_size),
            (layer.down, cfg.intermediate_size),
        )
        found += [(matmul, width) for matmul, width in pairs if matmul is not None]
    return [*found, (model.lm_head, cfg.hidden_size)]


def matmul_pass(
    weights: list[tuple[SizedCalls, int]], rows: int, model: Model, served: bool = True
) -> Callable[[], None]:
    """Every matmul once on `rows` rows: as the worker calls it (`served`: in calls of its
    checked row sizes), or in one call of the library's kernel."""
    inputs = {
        width: torch.randn(rows, width, dtype=model.dtype, device=model.device)
        for width in {width for _, width in weights}
    }

    def run() -> None:
        for matmul, width in weights:
            if served:
                matmul(inputs[width])
            else:
                matmul.kernel(inputs[width])

    return run


def sdpa_pass(model: Model, batch: int, context: int) -> Callable[[], None]:
    """F.scaled_dot_product_attention decoding one token per row over every layer's KV,
    each layer's a contiguous [batch, kv_heads, context, head_dim] of its own; a KV head's
    query heads are its queries (no mask: decode), so that no backend needs GQA."""
    cfg, dtype, device = model.config, model.dtype, model.device
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    q = torch.randn(batch, cfg.num_key_value_heads, group, cfg.head_dim, dtype=dtype, device=device)
    kv = [
        (
            torch.randn(shape, dtype=dtype, device=device),
            torch.randn(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_hidden_layers)
    ]

    def run() -> None:
        for k, v in kv:
            F.scaled_dot_product_attention(q, k, v)

    return run


def kernel_trials(kernels: dict[str, Any]) -> list[dict[str, Any]]:
    """The chooser's trials (gpu_worker.kernel_choice's report): each candidate of each
    seam, its best ms or its failure, and whether it was picked."""
    return [
        {"seam": seam, "candidate": name, "ms": ms, "chosen": kernels.get(seam) == name}
        for seam, trials in kernels.get("measured", {}).items()
        for name, ms in trials.items()
    ]


def row_sizes() -> list[dict[str, Any]]:
    """gpu_worker.linear's checks in this process: per weight shape and kernel, the call
    sizes offered and those kept (which agree bit for bit). A check's description is the
    repr of (shape, dtype, device, bias, kernel, threads, sizes offered, probe); one that
    does not read so is shown whole."""
    rows = []
    for text, kept in checked_sizes().items():
        try:
            shape, dtype, _, _, kind, _, offered, _ = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError):
            rows.append({"check": text, "kept": " ".join(map(str, kept))})
            continue
        dropped = [size for size in offered if size not in kept]
        rows.append(
            {"weight": "x".join(map(str, shape)), "dtype": dtype, "kernel": kind}
            | {"kept": " ".join(map(str, kept)), "dropped": " ".join(map(str, dropped)) or "-"}
        )
    return rows


def timing_row(
    what: str,
    ms: float,
    cost: ModelCost,
    machine: Machine,
    *,
    tokens: int,
    kv_tokens: int,
    attention_pairs: int,
    decoded: int,
) -> dict[str, Any]:
    """A measured step beside its roofline: the larger of its bytes' time at the machine's
    bandwidth and its flops' time at its matmul rate."""
    memory_s, compute_s = step_times(cost, machine, tokens, kv_tokens, attention_pairs)
    roofline_ms = max(memory_s, compute_s) * 1000
    row = {
        "step": what,
        "ms": round(ms, 3),
        "memory_ms": figures(memory_s * 1000),
        "compute_ms": figures(compute_s * 1000),
        "roofline_ms": figures(roofline_ms),
        "roofline_ratio": figures(roofline_ms / ms),
        "decoded_tok_per_s": round(decoded / ms * 1000, 1),
    }
    say(f"{what}: {row['ms']} ms, roofline {row['roofline_ms']} ms ({row['roofline_ratio']})")
    return row


def _kv_memory(runner: ModelRunner) -> dict[str, Any]:
    handshake = runner.handshake
    assert handshake is not None
    found: dict[str, Any] = {
        "kv_memory": 0.9,
        "num_blocks": handshake.num_blocks,
        "kv_gib": round(handshake.kv_bytes / 2**30, 2),
    }
    if runner.model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(runner.model.device)
        found |= {
            "device_gib": round(total / 2**30, 2),
            "kv_share_of_device": round(handshake.kv_bytes / total, 3),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "free_after_steps_gib": round(free / 2**30, 2),
        }
    return found


def _last_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return f"{type(exc).__name__}: {lines[-1][:300]}"
