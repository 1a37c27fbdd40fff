"""The device check's flex probes: FlexAttention (gpu_worker.attention), compiled as the
worker compiles it, on the shapes where Inductor's choices break it or slow it.

- short chunks: a prefill chunk of each short length class (2-127 tokens) at each GQA
  group size a model has (1, 2, 4, 8 query heads per KV head), against TorchAttention: the
  lengths where Inductor's flex-decoding lowering found no valid config;
- decode kernels: the CUDA kernels one decode call runs at batch 1 and 64 (torch.profiler),
  whether Inductor's flex-decoding template is among them, and the call's time beside the
  floor of reading its KV once; cadence's own Triton decode kernel on the same rows, its
  time and its difference from the reference. Template kernels are named by the graph's
  operator (`triton_tem_fused_flex_attention_N` for either template), so the template is
  told by its source: only flex-decoding's defines SPLIT_KV;
- graph replay: the batch-64 decode captured in a CUDA graph, replayed on new queries,
  equal to the same call run eagerly.

On a CPU FlexAttention runs eagerly (nothing is compiled): the probes run as a check of
the script, the kernel names are the CPU's operators, and there is no graph to replay.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpu_worker.attention import FlexAttention, TorchAttention, flex_backend, metadata_for
from gpu_worker.kernel_choice import TOLERANCE, AttentionCase, Shapes, attention_case, run_prefill
from ops.device_report import say
from ops.device_sections import Context

SHORT_CHUNKS = (2, 3, 17, 33, 64, 100, 127)  # each class of short length, both ends
GROUPS = (1, 2, 4, 8)
KV_HEADS, HEAD_DIM = 2, 64
CHUNK_START = 70  # a cached prefix before the chunk, ending mid-block
DECODE_HEADS, DECODE_KV_HEADS = 32, 8  # Llama-3.2-1B's
DECODE_BATCHES = (1, 64)
CPU_DECODE_BATCHES = (1, 4)  # eager FlexAttention is dense over the whole cache


def flex_probes(ctx: Context) -> dict[str, Any]:
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    context = 1024 if ctx.cuda else 64
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
    seconds = _median_seconds(call, 20 if ctx.cuda else 3)
    kv_bytes = sum(case.lens) * 2 * DECODE_KV_HEADS * HEAD_DIM * dtype.itemsize
    floor = kv_bytes / ctx.machine()[0].bandwidth
    row = {
        "batch": batch,
        "context_tokens": sum(case.lens),
        "kernels": ", ".join(kernel_names(call, ctx.cuda)),
        "decoding_template": template,
        "attention_us": round(seconds * 1e6, 1),
        "kv_floor_us": round(floor * 1e6, 2),
        "floor_ratio": round(floor / seconds, 3),
        "ok": template is not False,  # unknown where nothing was compiled
    }
    if ctx.cuda:
        row |= triton_decode(case, dtype, template is not False)
    say(f"decode: {row}")
    return row


def triton_decode(case: AttentionCase, dtype: torch.dtype, ok: bool) -> dict[str, Any]:
    """cadence's own Triton decode kernel (gpu_worker.attention.triton_backend) on the same
    rows: its time, and its largest difference from the reference."""
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
        "triton_us": round(_median_seconds(call, 20) * 1e6, 1),
        "triton_max_abs_diff": round(diff, 5),
        "ok": ok and diff < TOLERANCE[dtype],
    }


def graph_replay(ctx: Context, context: int, dtype: torch.dtype) -> dict[str, Any]:
    if not ctx.cuda:
        return {"ran": "no: CUDA graphs need CUDA", "ok": True}
    batch = DECODE_BATCHES[-1]
    case = attention_case(_shapes(ctx, DECODE_HEADS, DECODE_KV_HEADS, dtype), batch, 16, context)
    call = decode_call(FlexAttention(), case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-ups off the capture stream, as torch.cuda.graph asks
        call()
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = call()
    case.q_decode.copy_(torch.randn_like(case.q_decode))  # the graph reads its queries anew
    graph.replay()
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


def kernel_names(call: Callable[[], Any], cuda: bool) -> list[str]:
    """The device kernels one `call` launches (on a CPU, the operators it runs)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        call()
        _synchronize(cuda)
    if cuda:
        return sorted({e.name for e in prof.events() if e.device_type == DeviceType.CUDA})
    return sorted({e.name for e in prof.events() if e.name.startswith("aten::")})[:8]


def _median_seconds(call: Callable[[], Any], repeats: int) -> float:
    cuda = torch.cuda.is_available()
    call()
    times = []
    for _ in range(repeats):
        _synchronize(cuda)
        started = time.perf_counter()
        call()
        _synchronize(cuda)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _last_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return f"{type(exc).__name__}: {lines[-1][:300]}"
