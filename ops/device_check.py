"""The prepared GPU smoke run: one command that shows the worker correct and timed on a GPU.

    python -m ops.gpu_smoke OUT_DIR [--device cuda] [--quick] [--hbm-tbps 4.8]

It builds random-weight Llama and Qwen2 models in OUT_DIR with transformers (no downloads),
runs them through gpu_worker's ModelRunner and writes OUT_DIR/report.json and report.md:
logits against transformers at float32 and bfloat16; a prompt chunked against the same
prompt unchunked; a sequence decoded beside others against alone; CUDA graphs on against
off; a 3,000-token prompt in 512-token chunks beside decoders; seeded sampling; a timing
table, each row beside its HBM roofline (the bytes a step must read, weights and KV, over
the memory bandwidth); and the KV memory a `kv_memory=0.9` worker takes.

On a GPU, agreement is reported as rates and largest differences: the kernels reduce in
other orders than transformers and than each other. A section that fails records its
error and the run goes on, so one prepared run on a borrowed machine yields every result
it can. It exits 1 when a check failed.

It imports gpu_worker, torch, transformers and numpy only (GPU hosts may lack the service's
dependencies). `--device cpu --quick` runs tiny models and a few rows on a CPU: the test
suite runs it so that the script is known to run unchanged on the first GPU host.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu_worker import runtime
from gpu_worker.protocol import BatchPlan, SamplingSpec, WorkerConfig
from gpu_worker.runner import ModelRunner
from ops.roofline import BF16_BYTES, ModelCost

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Profile:
    """What to build and run: the full run for one H200, or a quick one for a CPU."""

    check_model: dict[str, int]  # transformers config overrides of the checked models
    timing_model: dict[str, int]  # of the model the timing table runs
    long_prompt: int
    chunk: int
    decoders: int
    decode_batches: tuple[int, ...]
    context: int  # of the decode rows and the mixed row's decoders
    mixed_decoders: int
    long_context: int
    long_batches: tuple[int, ...]
    repeats: int


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
    context=1024,
    mixed_decoders=64,
    long_context=8192,
    long_batches=(1, 32),
    repeats=10,
)
QUICK = Profile(
    check_model=TINY,
    timing_model=TINY,
    long_prompt=300,
    chunk=64,
    decoders=2,
    decode_batches=(1, 4),
    context=64,
    mixed_decoders=4,
    long_context=512,
    long_batches=(1,),
    repeats=2,
)


def build_model(path: Path, kind: str, overrides: dict[str, int], device: str) -> Path:
    """A random-weight Hugging Face model saved to `path` (bfloat16 when large)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

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


# ---- running steps ------------------------------------------------------------------------


@dataclass(slots=True)
class Seq:
    """One sequence's part of a step."""

    seq_id: int
    tokens: list[int]
    start: int
    table: list[int]
    sample: bool = True
    spec: SamplingSpec = field(default_factory=SamplingSpec)


def plan_of(seqs: list[Seq], step_id: int = 0, num_groups: int = 1) -> BatchPlan:
    """The step of `seqs`. On a cache of `num_groups` KV groups (a hybrid model's), entry
    b of a table is block b x num_groups + g in group g: no two groups share a block."""

    def spread(table: list[int], group: int) -> list[int]:
        return [block * num_groups + group for block in table]

    return BatchPlan(
        step_id=step_id,
        seq_ids=[s.seq_id for s in seqs],
        num_tokens=[len(s.tokens) for s in seqs],
        start_pos=[s.start for s in seqs],
        input_ids=[t for s in seqs for t in s.tokens],
        block_tables=[spread(s.table, 0) for s in seqs],
        group_tables=[[spread(s.table, g) for g in range(1, num_groups)] for s in seqs]
        if num_groups > 1
        else [],
        sample=[s.sample for s in seqs],
        sampling=[s.spec for s in seqs],
    )


class Blocks:
    """Hands out consecutive block ids (a section's sequences never share blocks)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, tokens: int) -> list[int]:
        count = -(-tokens // BLOCK_SIZE)
        self.next += count
        return list(range(self.next - count, self.next))


def tokens_of(count: int, seed: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=generator).tolist()


def execute(runner: ModelRunner, seqs: list[Seq]) -> list[int]:
    result = runner.execute(plan_of(seqs))
    if result.error is not None:
        raise RuntimeError(result.error)
    return [row[0] for row in result.tokens]  # one token per sampled sequence


def prefill(runner: ModelRunner, seq: Seq, chunk: int) -> torch.Tensor:
    """Feeds seq.tokens from seq.start in chunks of `chunk`; the last one's logits [vocab]."""
    for first in range(0, len(seq.tokens), chunk):
        part = seq.tokens[first : first + chunk]
        last = first + chunk >= len(seq.tokens)
        plan = plan_of([Seq(seq.seq_id, part, seq.start + first, seq.table, sample=last)])
        logits = runner.step_logits(plan)
    return logits[0]


def greedy(
    runner: ModelRunner,
    seq: Seq,
    steps: int,
    company: Callable[[int], list[Seq]] = lambda step: [],
) -> list[int]:
    """Prefills seq, then decodes `steps` tokens, each step beside company(step)."""
    out = execute(runner, [seq])
    for step in range(steps - 1):
        position = seq.start + len(seq.tokens) + step
        decode = Seq(seq.seq_id, [out[-1]], position, seq.table)
        out.append(execute(runner, [decode, *company(step)])[0])
    return out


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    got, want = got.float().cpu(), want.float().cpu()
    return {
        "max_abs_diff": round((got - want).abs().max().item(), 6),
        "argmax_agreement": round((got.argmax(-1) == want.argmax(-1)).float().mean().item(), 4),
    }


# ---- the sections -------------------------------------------------------------------------


class Smoke:
    def __init__(self, out: Path, device: str, profile: Profile, kernels: str, hbm_tbps: float):
        self.out = out
        self.device = device
        self.profile = profile
        self.kernels = kernels
        self.bandwidth = hbm_tbps * 1e12
        self.serving_dtype = "bfloat16" if device.startswith("cuda") else "float32"
        self.runners: dict[tuple, ModelRunner] = {}

    def model_dir(self, kind: str, timing: bool = False) -> Path:
        name = f"{kind}-timing" if timing else kind
        overrides = self.profile.timing_model if timing else self.profile.check_model
        return build_model(self.out / "models" / name, kind, overrides, self.device)

    def runner(self, kind: str, dtype: str, **overrides: Any) -> ModelRunner:
        """One runner per model and settings, kept for the sections that share it."""
        timing = overrides.pop("timing", False)
        key = (kind, dtype, timing, tuple(sorted(overrides.items())))
        if key not in self.runners:
            settings = dict(
                model_dir=str(self.model_dir(kind, timing)),
                dtype=dtype,
                device=self.device,
                block_size=BLOCK_SIZE,
                kv_memory=0.3,
                max_num_seqs=16,
                max_num_batched_tokens=8192,  # the smoke run's chunks go up to 2048 tokens
                seed=0,
                kernels=self.kernels,
                kernel_cache=str(self.out / "kernels.json"),
            )
            self.runners[key] = runtime.start(WorkerConfig(**{**settings, **overrides}))
        return self.runners[key]

    def release(self) -> None:
        self.runners.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def vocab(self) -> int:
        return self.profile.check_model["vocab_size"]

    def logits_vs_transformers(self) -> list[dict[str, Any]]:
        """Last-position logits of prompts of several lengths, prefilled in one step."""
        from transformers import AutoModelForCausalLM

        lengths = (5, 17, 33, 64, 100, 150)
        rows = []
        for kind in ("llama", "qwen2"):
            for dtype in ("float32", "bfloat16"):
                runner = self.runner(kind, dtype)
                blocks = Blocks()
                prompts = [tokens_of(n, seed=n, vocab=self.vocab) for n in lengths]
                seqs = [Seq(i, p, 0, blocks.take(len(p))) for i, p in enumerate(prompts)]
                ours = runner.step_logits(plan_of(seqs))
                hf = AutoModelForCausalLM.from_pretrained(
                    self.model_dir(kind), dtype=getattr(torch, dtype)
                ).to(self.device)
                with torch.no_grad():
                    theirs = torch.stack(
                        [hf(torch.tensor([p], device=self.device)).logits[0, -1] for p in prompts]
                    )
                found = compare(ours, theirs)
                agreed = found["argmax_agreement"]
                ok = agreed == 1.0 if dtype == "float32" else agreed >= 0.8
                rows.append({"model": kind, "dtype": dtype, **found, "ok": ok})
                del hf
        return rows

    def chunked_vs_unchunked(self) -> dict[str, Any]:
        runner = self.runner("llama", self.serving_dtype)
        prompt = tokens_of(self.profile.long_prompt // 3, seed=1, vocab=self.vocab)
        blocks = Blocks()
        whole = prefill(runner, Seq(0, prompt, 0, blocks.take(len(prompt))), len(prompt))
        chunk = max(16, self.profile.chunk // 8)
        chunked = prefill(runner, Seq(1, prompt, 0, blocks.take(len(prompt))), chunk)
        found = compare(chunked[None], whole[None])
        return {
            "prompt": len(prompt),
            "chunk": chunk,
            **found,
            "ok": found["argmax_agreement"] == 1,
        }

    def mixed_vs_alone(self) -> dict[str, Any]:
        """Greedy tokens of one sequence decoded alone, then beside a prefill chunk and
        other decoders at every step."""
        runner = self.runner("llama", self.serving_dtype)
        steps, blocks = 24, Blocks()
        prompt = tokens_of(40, seed=2, vocab=self.vocab)
        alone = greedy(runner, Seq(0, prompt, 0, blocks.take(40 + steps)), steps)
        other = tokens_of(steps * 32, seed=3, vocab=self.vocab)
        other_table = blocks.take(len(other))
        decoders = [(10 + i, blocks.take(200 + steps)) for i in range(3)]

        def company(step: int) -> list[Seq]:
            chunk = Seq(1, other[step * 32 : (step + 1) * 32], step * 32, other_table, False)
            rows = [Seq(i, [5 + i], 100 + step, table, False) for i, table in decoders]
            return [chunk, *rows]

        mixed = greedy(runner, Seq(2, prompt, 0, blocks.take(40 + steps)), steps, company)
        rate = agreement(mixed, alone)
        return {"steps": steps, "token_agreement": rate, "ok": rate >= 0.75}

    def graphs_on_vs_off(self) -> dict[str, Any]:
        """A decode batch of 8, greedy, with the decode steps replayed from graphs or not."""
        tokens = {}
        for graphs in (True, False):
            runner = self.runner("llama", self.serving_dtype, use_cuda_graphs=graphs)
            blocks, steps, out = Blocks(), 16, []
            for i in range(8):
                prompt = tokens_of(20 + 7 * i, seed=10 + i, vocab=self.vocab)
                out += greedy(runner, Seq(i, prompt, 0, blocks.take(len(prompt) + steps)), steps)
            tokens[graphs] = out
        rate = agreement(tokens[True], tokens[False])
        return {"sequences": 8, "steps": 16, "token_agreement": rate, "ok": rate >= 0.75}

    def long_prompt(self) -> dict[str, Any]:
        """The long prompt in chunks, each step beside decoders; its last logits against
        the same prompt in one chunk."""
        profile, runner = self.profile, self.runner("llama", self.serving_dtype)
        prompt = tokens_of(profile.long_prompt, seed=4, vocab=self.vocab)
        blocks = Blocks()
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
        return {
            "prompt": len(prompt),
            "chunk": profile.chunk,
            "decoders": profile.decoders,
            "step_ms": step_ms,
            **found,
            "ok": found["argmax_agreement"] == 1,
        }

    def sampler_with_seeds(self) -> dict[str, Any]:
        """Seeded sampling at temperature 1: the same seed gives the same tokens in another
        batch row and in another run; another seed, other tokens."""
        runner = self.runner("llama", self.serving_dtype)
        prompt = tokens_of(30, seed=5, vocab=self.vocab)
        runs = []
        for run in range(2):
            blocks, steps = Blocks(), 12
            seeds = (7, 7, 8)
            seqs = [
                Seq(
                    10 * run + i,
                    prompt,
                    0,
                    blocks.take(len(prompt) + steps),
                    True,
                    SamplingSpec(temperature=1.0, seed=seed),
                )
                for i, seed in enumerate(seeds)
            ]
            runs.append(self._sample_together(runner, seqs, steps))
        same_row = runs[0][0] == runs[0][1]
        same_run = runs[0] == runs[1]
        other_seed = runs[0][2] != runs[0][0]
        return {
            "tokens": runs[0],
            "same_seed_same_tokens_in_a_batch": same_row,
            "same_seed_same_tokens_across_runs": same_run,
            "other_seed_other_tokens": other_seed,
            "ok": same_row and same_run and other_seed,
        }

    def _sample_together(self, runner: ModelRunner, seqs: list[Seq], steps: int) -> list:
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

    def timings(self) -> dict[str, Any]:
        """Median step times of the timing model at kv_memory=0.9, each beside its floor."""
        self.release()
        runner = self.runner(
            "llama", self.serving_dtype, timing=True, kv_memory=0.9, max_num_seqs=128
        )
        config = runner.model.config
        profile = self.profile
        rows = [self._time_decode(runner, b, profile.context) for b in profile.decode_batches]
        rows.append(self._time_mixed(runner))
        rows += [self._time_decode(runner, b, profile.long_context) for b in profile.long_batches]
        return {
            "model": {
                "hidden": config.hidden_size,
                "layers": config.num_hidden_layers,
                "heads": config.num_attention_heads,
                "kv_heads": config.num_key_value_heads,
                "dtype": self.serving_dtype,
            },
            "kernels": {k: v for k, v in runner.handshake.kernels.items() if k != "measured"},
            "hbm_tb_per_s": self.bandwidth / 1e12,
            "rows": rows,
            "kv_memory": self._kv_memory(runner),
            "ok": True,
        }

    def _time_decode(self, runner: ModelRunner, batch: int, context: int) -> dict[str, Any]:
        blocks = Blocks()
        seqs = [Seq(i, [5], context - 1, blocks.take(context)) for i in range(batch)]
        return self._time(
            runner, f"decode, batch {batch}, context {context}", seqs, batch * context
        )

    def _time_mixed(self, runner: ModelRunner) -> dict[str, Any]:
        profile, blocks = self.profile, Blocks()
        chunk = Seq(0, tokens_of(profile.chunk, 6, 256), 0, blocks.take(profile.chunk), False)
        rows = [
            Seq(1 + i, [5], profile.context - 1, blocks.take(profile.context))
            for i in range(profile.mixed_decoders)
        ]
        what = f"mixed: a {profile.chunk}-token chunk + {profile.mixed_decoders} decodes"
        read = profile.chunk + profile.mixed_decoders * profile.context
        return self._time(runner, what, [chunk, *rows], read)

    def _time(
        self, runner: ModelRunner, what: str, seqs: list[Seq], kv_tokens: int
    ) -> dict[str, Any]:
        plan = plan_of(seqs)
        times = []
        for i in range(self.profile.repeats + 2):  # two warm-ups
            _synchronize()
            started = time.perf_counter()
            result = runner.execute(plan)
            _synchronize()
            if result.error is not None:
                raise RuntimeError(result.error)
            if i >= 2:
                times.append((time.perf_counter() - started) * 1000)
        cost = ModelCost.of(runner.model.config)
        scale = runner.model.dtype.itemsize / BF16_BYTES
        moved = (cost.weight_bytes + kv_tokens * cost.kv_bytes_per_token) * scale
        floor_ms = moved / self.bandwidth * 1000
        measured = statistics.median(times)
        return {
            "step": what,
            "ms": round(measured, 3),
            "bytes_read_mb": round(moved / 1e6, 1),
            "roofline_ms": _figures(floor_ms),
            "roofline_ratio": _figures(floor_ms / measured),
        }

    def _kv_memory(self, runner: ModelRunner) -> dict[str, Any]:
        found: dict[str, Any] = {
            "kv_memory": 0.9,
            "num_blocks": runner.handshake.num_blocks,
            "kv_gib": round(runner.handshake.kv_bytes / 2**30, 2),
        }
        if runner.model.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(runner.model.device)
            found |= {
                "device_gib": round(total / 2**30, 2),
                "kv_share_of_device": round(runner.handshake.kv_bytes / total, 3),
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "free_after_steps_gib": round(free / 2**30, 2),
            }
        return found


def _figures(x: float) -> float:
    """Four significant figures: the tiny models' floors are microseconds."""
    return float(f"{x:.4g}")


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


SECTIONS = (
    "logits_vs_transformers",
    "chunked_vs_unchunked",
    "mixed_vs_alone",
    "graphs_on_vs_off",
    "long_prompt",
    "sampler_with_seeds",
    "timings",
)


def run(smoke: Smoke) -> dict[str, Any]:
    report: dict[str, Any] = {"environment": environment(smoke.device)}
    for name in SECTIONS:
        started = time.perf_counter()
        try:
            report[name] = getattr(smoke, name)()
        except Exception:  # a failed section is a result; the others still run
            report[name] = {"ok": False, "error": traceback.format_exc()}
        seconds = round(time.perf_counter() - started, 1)
        print(f"{name}: {seconds} s", file=sys.stderr, flush=True)
    report["passed"] = all(section_ok(report[name]) for name in SECTIONS)
    return report


def section_ok(section: Any) -> bool:
    if isinstance(section, list):
        return all(row["ok"] for row in section)
    return bool(section["ok"])


def environment(device: str) -> dict[str, Any]:
    import transformers

    found = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
    }
    if device.startswith("cuda"):
        found |= {
            "gpu": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda,
            "triton": _version_of("triton"),
        }
    return found


def _version_of(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def markdown(report: dict[str, Any]) -> str:
    """The report as tables: one per section."""
    lines = ["# GPU smoke run", "", f"passed: {report['passed']}", "", "## environment", ""]
    lines += _table([report["environment"]])
    for name in SECTIONS:
        section = report[name]
        lines += ["", f"## {name}", ""]
        if isinstance(section, dict) and "error" in section:
            lines += ["```", section["error"].rstrip(), "```"]
        elif name == "timings":
            lines += [*_table(section["rows"]), "", "KV memory:", ""]
            lines += _table([section["kv_memory"]])
            lines += ["", f"kernels: {section['kernels']}; model: {section['model']}"]
        else:
            lines += _table(section if isinstance(section, list) else [section])
    return "\n".join(lines) + "\n"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.gpu_smoke",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models, a few rows")
    parser.add_argument("--kernels", default="auto", help="as the worker's --kernels")
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="H200: 4.8 TB/s")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    profile = QUICK if args.quick else FULL
    smoke = Smoke(args.out_dir, args.device, profile, args.kernels, args.hbm_tbps)
    report = run(smoke)
    (args.out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out_dir / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
