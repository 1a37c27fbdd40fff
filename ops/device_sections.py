"""The device check's sections but its probes and timings (ops.device_probes) and its
HTTP serve (ops.device_serve): what each builds, runs and measures, how it decides whether
it passed, and the Context every section is given.

The agreement sections run one after another in one process (ops.device_check's
AGREEMENT) and share its check-model workers: a worker is started by the first section
that asks for its settings (Context.runner) and kept for those after it; a section records
how many it started. Sequences are described whole (ops.worker_steps), so a section's
plans fit the worker whatever the sections before it left there.

On a GPU, agreement is reported as rates and largest differences: the kernels reduce in
other orders than transformers and than each other.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu_worker import runtime
from gpu_worker.protocol import SamplingSpec, WorkerConfig, block_size_for
from gpu_worker.runner import ModelRunner
from ops.device_report import result_path, say
from ops.roofline import Machine, measure_bandwidth, measure_matmul
from ops.worker_steps import (
    Blocks,
    Seq,
    agreement,
    compare,
    execute,
    greedy,
    plan_of,
    prefill,
    tokens_of,
)


@dataclass(frozen=True, slots=True)
class Profile:
    """What to build and run: the full run for one H200, or a quick one for a CPU."""

    check_model: dict[str, int]  # transformers config overrides of the checked models
    check_kv_bytes: int  # each check worker's KV cache: several are alive at once
    timing_model: dict[str, int]  # of the model the timing rows run
    long_prompt: int
    chunk: int
    decoders: int
    decode_batches: tuple[int, ...]
    profiled_batches: tuple[int, ...]  # decode steps taken apart, among decode_batches
    context: int  # of the decode rows and the mixed row's decoders
    mixed_decoders: int
    long_context: int
    long_batches: tuple[int, ...]
    repeats: int
    timed_calls: int  # back-to-back calls (or graph replays) a probe's time is the mean of
    generate_batches: tuple[int, ...]  # transformers.generate's, among decode_batches
    generate_tokens: int
    copy_megabytes: int
    matmul_size: int


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=1024,
)
FULL = Profile(
    check_model=dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
    ),
    check_kv_bytes=512 * 2**20,  # 2 KiB a token in bf16, 4 in fp32: the long prompt fits
    # A 1B-class Llama (Llama-3.2-1B's widths): rows long enough to mean something on a GPU.
    timing_model=dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
    ),
    long_prompt=3000,
    chunk=512,
    decoders=8,
    decode_batches=(1, 32, 64, 128),
    profiled_batches=(1, 64),
    context=1024,
    mixed_decoders=64,
    long_context=8192,
    long_batches=(1, 32),
    repeats=10,
    timed_calls=100,
    generate_batches=(1, 32),
    generate_tokens=32,
    copy_megabytes=1024,
    matmul_size=8192,
)
QUICK = Profile(
    check_model=TINY,
    check_kv_bytes=64 * 2**20,
    timing_model=TINY,
    long_prompt=300,
    chunk=64,
    decoders=2,
    decode_batches=(1, 4),
    profiled_batches=(1, 4),
    context=64,
    mixed_decoders=4,
    long_context=512,
    long_batches=(1,),
    repeats=2,
    timed_calls=3,
    generate_batches=(1, 4),
    generate_tokens=4,
    copy_megabytes=32,
    matmul_size=256,
)


def build_model(path: Path, kind: str, overrides: dict[str, int], device: str) -> Path:
    """A random-weight Hugging Face model saved to `path` (bfloat16 when large)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    _quiet_transformers()
    if (path / "config.json").exists():
        return path
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    # Wide enough a spread that greedy choices are clear, as the tests' tiny models.
    config = config_cls(**overrides, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):  # initialising a 1B model on the GPU takes a moment, not minutes
        model = model_cls(config).eval()
    if kind == "qwen2":  # random init leaves the q/k/v biases at zero, which tests nothing
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (attn := layer.self_attn).q_proj, attn.k_proj, attn.v_proj:
                    proj.bias.normal_(0, 0.5)
    large = overrides["hidden_size"] >= 1024
    model.to(torch.bfloat16 if large else torch.float32).save_pretrained(path)
    return path


def _quiet_transformers() -> None:
    """No progress bars: a section's output is its result lines."""
    from transformers.utils import logging

    logging.disable_progress_bar()


@dataclass(slots=True)
class Context:
    """What every section is given: the run's settings, and the runners and the service
    started in its process (kept for the sections after it)."""

    out: Path
    work: Path
    device: str
    profile: Profile
    kernels: str
    nominal: Machine  # the figures a timing row falls back on
    wheels: Path | None
    runners: dict[tuple, ModelRunner] = field(default_factory=dict)
    worker_starts: int = 0  # in this process
    server: Any = None  # an ops.device_serve.Server (which imports this), kept for the next
    last_in_process: bool = True  # of the running section: it stops the service it keeps

    @classmethod
    def of(cls, args: Any) -> Context:
        return cls(
            out=args.out_dir,
            work=args.work,
            device=args.device,
            profile=QUICK if args.quick else FULL,
            kernels=args.kernels,
            nominal=Machine(args.hbm_tbps * 1e12, args.matmul_tflops * 1e12),
            wheels=args.wheels,
        )

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def serving_dtype(self) -> str:
        return "bfloat16" if self.cuda else "float32"

    @property
    def block_size(self) -> int:
        """The worker's default on this device: what the sections' workers run with."""
        return block_size_for(None, "cuda" if self.cuda else "cpu")

    @property
    def vocab(self) -> int:
        return self.profile.check_model["vocab_size"]

    def model_dir(self, kind: str, timing: bool = False) -> Path:
        """The model's folder, built on first use; named by its shapes, so that a work
        folder kept between runs never serves a model of other shapes."""
        overrides = self.profile.timing_model if timing else self.profile.check_model
        digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()
        path = self.work / "models" / f"{kind}-{digest[:10]}"
        return build_model(path, kind, overrides, self.device)

    def runner(
        self, kind: str, dtype: str, graphs: bool = True, timing: bool = False, **overrides: Any
    ) -> ModelRunner:
        """The worker of this model and these settings: started on first use, then kept
        for every section of this process that asks for the same. The check model's
        settings are one set (max_num_seqs covers every agreement section), so that few
        workers serve them all."""
        key = (kind, dtype, graphs, timing, tuple(sorted(overrides.items())))
        if key not in self.runners:
            settings = dict(
                model_dir=str(self.model_dir(kind, timing)),
                dtype=dtype,
                device=self.device,
                kv_memory=self.profile.check_kv_bytes,
                max_num_seqs=16,
                max_num_batched_tokens=4096,  # the long prompt is also prefilled whole
                use_cuda_graphs=graphs,
                seed=0,
                kernels=self.kernels,
                kernel_cache=str(self.work / "kernels.json"),
            )
            started = time.perf_counter()
            self.runners[key] = runtime.start(WorkerConfig(**{**settings, **overrides}))
            self.worker_starts += 1
            say(f"worker started in {time.perf_counter() - started:.1f} s: {kind} {dtype}")
        return self.runners[key]

    def release(self, runner: ModelRunner) -> None:
        """Stops keeping `runner`, and gives its memory back."""
        self.runners = {key: kept for key, kept in self.runners.items() if kept is not runner}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def earlier(self, name: str) -> dict[str, Any] | None:
        """The result an earlier section of this run wrote, if it did."""
        try:
            return json.loads(result_path(self.out, name).read_text())
        except (OSError, ValueError):
            return None

    def machine(self) -> tuple[Machine, str]:
        """The measured machine (the `machine` section's), else the nominal figures."""
        found = self.earlier("machine")
        if found and found.get("ok"):
            return Machine(found["bandwidth"], found["matmul_flops"]), "measured"
        return self.nominal, "nominal"


# ---- environment and machine ----------------------------------------------------------------


def environment(ctx: Context) -> dict[str, Any]:
    import transformers

    from gpu_worker.attention import flex_backend

    found: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": _version_of("triton"),
        "device": ctx.device,
        "block_size": ctx.block_size,
        "compile_count_reported": hasattr(flex_backend, "compile_count"),
        "nvcc": nvcc_version(),
        "ok": True,
    }
    if ctx.cuda and not torch.cuda.is_available():
        found |= {"ok": False, "error": "torch.cuda.is_available() is False"}
    elif ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        found |= {
            "cuda": torch.version.cuda,
            "gpu": props.name,
            "capability": ".".join(map(str, torch.cuda.get_device_capability(ctx.device))),
            "sm_count": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _nvidia_smi("driver_version"),
            "cudnn": torch.backends.cudnn.version(),
        }
    for key, value in found.items():
        say(f"{key}: {value}")
    return found


def _version_of(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def nvcc_version() -> str:
    """`nvcc --version`'s release line (Triton ships its own ptxas: a host needs no nvcc to
    run the worker, only to build extensions), or why there is none."""
    nvcc = shutil.which("nvcc") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.is_file()), None
    )
    if nvcc is None:
        return "absent (no nvcc on PATH or in /usr/local/cuda/bin)"
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{nvcc} did not answer: {exc}"
    lines = [line for line in done.stdout.splitlines() if "release" in line]
    return (lines or done.stdout.strip().splitlines() or ["(no output)"])[-1].strip()


def _nvidia_smi(query: str) -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def machine(ctx: Context) -> dict[str, Any]:
    """A large copy's bandwidth and square bf16 matmuls' rate, each the best of 10."""
    profile = ctx.profile
    bandwidth = measure_bandwidth(profile.copy_megabytes, 10, ctx.device)
    say(f"copy of {profile.copy_megabytes} MiB: {bandwidth / 1e9:.0f} GB/s")
    flops = measure_matmul(profile.matmul_size, 10, ctx.device)
    say(f"bf16 matmul {profile.matmul_size}^3: {flops / 1e12:.4g} TFLOP/s")
    return {
        "copy_gb_per_s": round(bandwidth / 1e9, 1),
        "copy_share_of_nominal": round(bandwidth / ctx.nominal.bandwidth, 3),
        "bf16_matmul_tflop_per_s": figures(flops / 1e12),
        "matmul_share_of_nominal": round(flops / ctx.nominal.matmul_flops, 3),
        "copy_mib": profile.copy_megabytes,
        "matmul_size": profile.matmul_size,
        "bandwidth": bandwidth,
        "matmul_flops": flops,
        "ok": True,
    }


# ---- agreement ------------------------------------------------------------------------------


def logits_vs_transformers(ctx: Context) -> dict[str, Any]:
    """Last-position logits of prompts of several lengths, prefilled in one step."""
    from transformers import AutoModelForCausalLM

    lengths = (5, 17, 33, 64, 100, 150)
    rows = []
    for kind in ("llama", "qwen2"):
        for dtype in ("float32", "bfloat16"):
            runner = ctx.runner(kind, dtype, graphs=False)
            blocks = Blocks(runner.cache.block_size)
            prompts = [tokens_of(n, seed=n, vocab=ctx.vocab) for n in lengths]
            seqs = [Seq(i, p, 0, blocks.take(len(p))) for i, p in enumerate(prompts)]
            ours = runner.step_logits(plan_of(seqs))
            hf = AutoModelForCausalLM.from_pretrained(
                ctx.model_dir(kind), dtype=getattr(torch, dtype)
            ).to(ctx.device)
            with torch.no_grad():
                theirs = torch.stack(
                    [hf(torch.tensor([p], device=ctx.device)).logits[0, -1] for p in prompts]
                )
            found = compare(ours, theirs)
            agreed = found["argmax_agreement"]
            ok = agreed == 1.0 if dtype == "float32" else agreed >= 0.8
            rows.append({"model": kind, "dtype": dtype, **found, "ok": ok})
            say(f"{rows[-1]}")
            del hf
            if (kind, dtype) != ("llama", ctx.serving_dtype):  # no later section asks for it
                ctx.release(runner)
    return {"rows": rows, "ok": all(row["ok"] for row in rows)}


def chunked_vs_unchunked(ctx: Context) -> dict[str, Any]:
    runner = ctx.runner("llama", ctx.serving_dtype, graphs=False)
    prompt = tokens_of(ctx.profile.long_prompt // 3, seed=1, vocab=ctx.vocab)
    blocks = Blocks(runner.cache.block_size)
    whole = prefill(runner, Seq(0, prompt, 0, blocks.take(len(prompt))), len(prompt))
    chunk = max(16, ctx.profile.chunk // 8)
    chunked = prefill(runner, Seq(1, prompt, 0, blocks.take(len(prompt))), chunk)
    found = compare(chunked[None], whole[None])
    say(f"{found}")
    return {"prompt": len(prompt), "chunk": chunk, **found, "ok": found["argmax_agreement"] == 1}


def mixed_vs_alone(ctx: Context) -> dict[str, Any]:
    """Greedy tokens of one sequence decoded alone, then beside a prefill chunk and other
    decoders at every step."""
    runner = ctx.runner("llama", ctx.serving_dtype)
    steps, blocks = 24, Blocks(runner.cache.block_size)
    prompt = tokens_of(40, seed=2, vocab=ctx.vocab)
    alone = greedy(runner, Seq(0, prompt, 0, blocks.take(40 + steps)), steps)
    other = tokens_of(steps * 32, seed=3, vocab=ctx.vocab)
    other_table = blocks.take(len(other))
    decoders = [(10 + i, blocks.take(200 + steps)) for i in range(3)]

    def company(step: int) -> list[Seq]:
        chunk = Seq(1, other[step * 32 : (step + 1) * 32], step * 32, other_table, False)
        rows = [Seq(i, [5 + i], 100 + step, table, False) for i, table in decoders]
        return [chunk, *rows]

    mixed = greedy(runner, Seq(2, prompt, 0, blocks.take(40 + steps)), steps, company)
    rate = agreement(mixed, alone)
    say(f"token agreement {rate}")
    return {"steps": steps, "token_agreement": rate, "ok": rate >= 0.75}


def graphs_on_vs_off(ctx: Context) -> dict[str, Any]:
    """Eight sequences decoded greedily, with the decode steps replayed from graphs or not."""
    tokens = {}
    for graphs in (True, False):
        runner = ctx.runner("llama", ctx.serving_dtype, graphs=graphs)
        blocks, steps, out = Blocks(runner.cache.block_size), 16, []
        for i in range(8):
            prompt = tokens_of(20 + 7 * i, seed=10 + i, vocab=ctx.vocab)
            out += greedy(runner, Seq(i, prompt, 0, blocks.take(len(prompt) + steps)), steps)
        tokens[graphs] = out
    rate = agreement(tokens[True], tokens[False])
    say(f"token agreement {rate}")
    return {"sequences": 8, "steps": 16, "token_agreement": rate, "ok": rate >= 0.75}


def long_prompt(ctx: Context) -> dict[str, Any]:
    """The long prompt in chunks, each step beside decoders; its last logits against
    the same prompt in one chunk."""
    profile, runner = ctx.profile, ctx.runner("llama", ctx.serving_dtype)
    prompt = tokens_of(profile.long_prompt, seed=4, vocab=ctx.vocab)
    blocks = Blocks(runner.cache.block_size)
    whole = prefill(runner, Seq(0, prompt, 0, blocks.take(len(prompt))), len(prompt))
    table = blocks.take(len(prompt))
    decoders = [(10 + i, blocks.take(64 + len(prompt))) for i in range(profile.decoders)]
    step_ms = []
    for first in range(0, len(prompt), profile.chunk):
        part = prompt[first : first + profile.chunk]
        step = first // profile.chunk
        rows = [Seq(i, [7], 32 + step, t, False) for i, t in decoders]
        last = first + profile.chunk >= len(prompt)
        started = time.perf_counter()
        logits = runner.step_logits(plan_of([Seq(1, part, first, table, last), *rows]))
        step_ms.append(round((time.perf_counter() - started) * 1000, 2))
    found = compare(logits[:1], whole[None])
    say(f"{found}; step ms {step_ms}")
    return {
        "prompt": len(prompt),
        "chunk": profile.chunk,
        "decoders": profile.decoders,
        "step_ms": step_ms,
        **found,
        "ok": found["argmax_agreement"] == 1,
    }


def sampler_with_seeds(ctx: Context) -> dict[str, Any]:
    """Seeded sampling at temperature 1: the same seed gives the same tokens in another
    batch row and in another run; another seed, other tokens."""
    runner = ctx.runner("llama", ctx.serving_dtype)
    prompt = tokens_of(30, seed=5, vocab=ctx.vocab)
    runs = []
    for run in range(2):
        blocks, steps = Blocks(runner.cache.block_size), 12
        seqs = [
            Seq(10 * run + i, prompt, 0, blocks.take(len(prompt) + steps), True, spec)
            for i, spec in enumerate(SamplingSpec(temperature=1.0, seed=s) for s in (7, 7, 8))
        ]
        runs.append(_sample_together(runner, seqs, steps))
    same_row = runs[0][0] == runs[0][1]
    same_run = runs[0] == runs[1]
    other_seed = runs[0][2] != runs[0][0]
    say(f"same seed, same row: {same_row}; across runs: {same_run}; other seed: {other_seed}")
    return {
        "tokens": runs[0],
        "same_seed_same_tokens_in_a_batch": same_row,
        "same_seed_same_tokens_across_runs": same_run,
        "other_seed_other_tokens": other_seed,
        "ok": same_row and same_run and other_seed,
    }


def _sample_together(runner: ModelRunner, seqs: list[Seq], steps: int) -> list[list[int]]:
    out = [[t] for t in execute(runner, seqs)]
    for step in range(steps - 1):
        position = len(seqs[0].tokens) + step
        rows = [
            Seq(s.seq_id, [o[-1]], position, s.table, True, s.spec)
            for s, o in zip(seqs, out, strict=True)
        ]
        for o, token in zip(out, execute(runner, rows), strict=True):
            o.append(token)
    return out


# ---- a speed reference ----------------------------------------------------------------------


def transformers_generate(ctx: Context) -> dict[str, Any]:
    """The timing model's weights through transformers.generate (greedy, its own eager
    path), as a speed reference: decoded tokens per second at the decode rows' context,
    beside cadence's decode row of the same batch."""
    from transformers import AutoModelForCausalLM

    profile = ctx.profile
    model = AutoModelForCausalLM.from_pretrained(
        ctx.model_dir("llama", timing=True), dtype=getattr(torch, ctx.serving_dtype)
    ).to(ctx.device)
    ours = {row["step"]: row for row in (ctx.earlier("decode_timings") or {}).get("rows", [])}
    rows = []
    for batch in profile.generate_batches:
        vocab = model.config.vocab_size
        prompts = [tokens_of(profile.context, seed=row, vocab=vocab) for row in range(batch)]
        prompt = torch.tensor(prompts, device=ctx.device)
        generate = _generate_timer(model, prompt)
        generate(2)  # warm-up
        # The decode steps' seconds: the whole generate's, less its prefill's.
        seconds = max(generate(1 + profile.generate_tokens) - generate(1), 1e-9)
        theirs = batch * profile.generate_tokens / seconds
        mine = ours.get(f"decode, batch {batch}, context {profile.context}", {})
        row = {
            "batch": batch,
            "context": profile.context,
            "transformers_tok_per_s": round(theirs, 1),
            "cadence_tok_per_s": mine.get("decoded_tok_per_s"),
        }
        if row["cadence_tok_per_s"]:
            row["cadence_over_transformers"] = round(row["cadence_tok_per_s"] / theirs, 2)
        say(f"{row}")
        rows.append(row)
    return {"rows": rows, "ok": True}


def _generate_timer(model: Any, prompt: torch.Tensor) -> Callable[[int], float]:
    def seconds(new_tokens: int) -> float:
        synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        synchronize()
        return time.perf_counter() - started

    return seconds


def figures(x: float) -> float:
    """Four significant figures: the tiny models' floors are microseconds."""
    return float(f"{x:.4g}")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
