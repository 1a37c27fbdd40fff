"""How much weights kept quantized change the model's answers.

    cadence bench weight-accuracy [--model DIR] [--dtype bfloat16] [--tokens 48]
                                  [--quantization int8 int4 gguf]

kv-accuracy's measure (ops.kv_accuracy), with the weights quantized instead of the cache:
each prompt of its varied set runs greedily with dense weights for --tokens tokens, then the
same tokens run teacher forced through a worker with each quantization, compared position by
position (greedy agreement, first divergence, each row's largest logit error relative to its
largest |logit|). gguf (the file's own quantized weights) is measured where the model was
converted from a GGUF file; the reference is then its weights dequantized, in --dtype.
"""

from __future__ import annotations

import argparse

import torch

from gpu_worker.protocol import QUANTIZED_WEIGHTS
from ops.kv_accuracy import compare, prompts, reference_answers, runner_for
from service.config import default_cache_dir
from service.model_files.resolve import resolve_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence bench weight-accuracy", description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=48, help="answer tokens per prompt")
    parser.add_argument("--quantization", nargs="+", default=["int8", "int4", "gguf"])
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = resolve_model(args.model, default_cache_dir())
    prompt_set = prompts(model_dir)
    reference = runner_for(model_dir, args.dtype, "auto")
    lengths = sorted(len(p) for p in prompt_set)
    print(
        f"{len(prompt_set)} prompts of {lengths[0]}..{lengths[-1]} tokens, {args.tokens} answer "
        f"tokens each; reference: {args.dtype} weights"
    )
    print("weights  agreement  first divergence (per prompt)   max err  mean err")
    answers = reference_answers(reference, prompt_set, args.tokens)
    for name in args.quantization:
        if name == "gguf" and not (model_dir / QUANTIZED_WEIGHTS).is_file():
            print(f"{name:7}  (not a GGUF conversion)")
            continue
        result = compare(answers, runner_for(model_dir, args.dtype, "auto", name))
        firsts = " ".join("-" if d is None else str(d) for d in result.first_divergence)
        print(
            f"{name:7} {result.rate:10.1%}  {firsts:30}  "
            f"{result.max_error:7.2%} {result.mean_error:8.2%}"
        )
    return 0
