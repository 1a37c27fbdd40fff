"""How much an 8-bit KV cache changes the model's answers.

    cadence bench kv-accuracy [--model DIR] [--dtype bfloat16] [--tokens 48]
                              [--kv-cache-dtype int8 fp8]

Each prompt of a varied set (chat questions, code, a long passage of the benchmark corpus,
random token ids) runs greedily with a cache of the model's own dtype for --tokens tokens;
then the same tokens (prompt and answer, teacher forcing) run through a worker with each
8-bit cache, and the two are compared position by position over the answer:
- agreement: how often the 8-bit cache's greedy token is the reference's;
- first divergence: where the 8-bit cache would first have answered differently;
- logit error: the largest |difference| in a row's logits, and its mean over rows,
  relative to the row's largest |logit|.
It also prints how many blocks each cache holds in the same memory.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker import runtime
from gpu_worker.protocol import WorkerConfig
from gpu_worker.runner import ModelRunner
from ops.corpus import full_text
from ops.worker_steps import Seq, steps_for
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer

QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
)
KV_MEMORY = float(1 << 28)


@dataclass(slots=True)
class Agreement:
    positions: int
    agreeing: int
    first_divergence: list[int | None]  # per prompt: the first differing answer position
    max_error: float  # largest |logit difference| / the row's largest |logit|
    mean_error: float

    @property
    def rate(self) -> float:
        return self.agreeing / self.positions


def prompts(model_dir: Path, count_random: int = 2) -> list[list[int]]:
    """Chat questions, a long passage and random ids: short and long contexts, text and
    noise."""
    tokenizer = Tokenizer.from_dir(model_dir)
    chats = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in QUESTIONS
    ]
    passage = tokenizer.encode(full_text())[:1500]
    generator = torch.Generator().manual_seed(0)
    noise = [
        torch.randint(3, 49152, (n,), generator=generator).tolist()
        for n in (64, 300)[:count_random]
    ]
    return [*chats, passage, *noise]


def runner_for(
    model_dir: Path, dtype: str, kv_cache_dtype: str, quantization: str = "none"
) -> ModelRunner:
    config = WorkerConfig(
        model_dir=str(model_dir),
        dtype=dtype,
        device="cpu",
        kv_memory=KV_MEMORY,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        kernel_cache=str(default_cache_dir() / "kernels.json"),
    )
    return runtime.start(config)


def row_logits(runner: ModelRunner, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Float32 logits predicting tokens[prompt_len:] and one more, teacher forced: the prompt
    in one chunk, then one token per step (as decoding runs)."""
    table = list(range(-(-(len(tokens) + 1) // runner.cache.block_size)))
    rows = [_step(runner, tokens[:prompt_len], 0, table)]
    for position in range(prompt_len, len(tokens)):
        rows.append(_step(runner, [tokens[position]], position, table))
    return torch.stack(rows)


def _step(runner: ModelRunner, tokens: list[int], start: int, table: list[int]) -> torch.Tensor:
    return runner.step_logits(steps_for(runner).plan([Seq(0, tokens, start, table)]))[0]


def greedy_answer(
    runner: ModelRunner, prompt: list[int], count: int
) -> tuple[list[int], torch.Tensor]:
    """`count` greedy tokens, and the logits each was chosen from: the steps are
    row_logits's own (the prompt in one chunk, then one token per step), so these are the
    rows it would compute, teacher forced over the answer, without computing them again."""
    tokens = list(prompt)
    table = list(range(-(-(len(prompt) + count) // runner.cache.block_size)))
    rows = [_step(runner, prompt, 0, table)]
    while True:
        tokens.append(int(rows[-1].argmax()))
        if len(tokens) == len(prompt) + count:
            return tokens[len(prompt) :], torch.stack(rows)
        rows.append(_step(runner, [tokens[-1]], len(tokens) - 1, table))


@dataclass(slots=True)
class Answer:
    """A prompt's greedy answer on the reference cache, and the reference's float32 logits
    at each of the answer's positions, teacher forced."""

    prompt: list[int]
    tokens: list[int]
    logits: torch.Tensor


def reference_answers(
    reference: ModelRunner, prompt_set: list[list[int]], count: int
) -> list[Answer]:
    answers = []
    for prompt in prompt_set:
        answers.append(Answer(prompt, *greedy_answer(reference, prompt, count)))
    return answers


def compare(answers: list[Answer], quantized: ModelRunner) -> Agreement:
    """How often the quantized cache, teacher forced over the reference's answers, picks
    the same token, and how far its logits are from the reference's."""
    agreeing = positions = 0
    divergences: list[int | None] = []
    errors: list[float] = []
    for answer in answers:
        got = row_logits(quantized, answer.prompt + answer.tokens, len(answer.prompt))[:-1]
        same = got.argmax(dim=-1) == torch.tensor(answer.tokens)
        agreeing += int(same.sum())
        positions += len(answer.tokens)
        differing = (~same).nonzero()
        divergences.append(int(differing[0]) if len(differing) else None)
        want = answer.logits
        scale = want.abs().amax(dim=-1)
        errors += ((got - want).abs().amax(dim=-1) / scale).tolist()
    return Agreement(positions, agreeing, divergences, max(errors), statistics.fmean(errors))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence bench kv-accuracy", description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=48, help="answer tokens per prompt")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["int8", "fp8"])
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = resolve_model(args.model, default_cache_dir())
    prompt_set = prompts(model_dir)
    reference = runner_for(model_dir, args.dtype, "auto")
    lengths = sorted(len(p) for p in prompt_set)
    print(
        f"{len(prompt_set)} prompts of {lengths[0]}..{lengths[-1]} tokens, {args.tokens} answer "
        f"tokens each; reference: a {args.dtype} cache of {reference.handshake.num_blocks} "
        f"blocks in {KV_MEMORY / 2**20:.0f} MiB"
    )
    print("cache   blocks  agreement  first divergence (per prompt)   max err  mean err")
    answers = reference_answers(reference, prompt_set, args.tokens)
    for name in args.kv_cache_dtype:
        quantized = runner_for(model_dir, args.dtype, name)
        result = compare(answers, quantized)
        firsts = " ".join("-" if d is None else str(d) for d in result.first_divergence)
        print(
            f"{name:6} {quantized.handshake.num_blocks:7} {result.rate:10.1%}  {firsts:30}  "
            f"{result.max_error:7.2%} {result.mean_error:8.2%}"
        )
    return 0
