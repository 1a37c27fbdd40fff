"""The default model's decode steps through cadence's Triton kernels (its decode attention;
add + RMSNorm, RoPE + paged K/V write, SiLU x mul), run on the CPU by Triton's interpreter:
the worker answers as with the PyTorch reference kernels.

The kernels are offered on CUDA only. The subprocess, under TRITON_INTERPRET=1 (set before
they are decorated, as in tests/test_worker_triton_attention.py), prefills the question and
the first words of the answer with the reference kernels (an interpreted prefill would take
minutes; the prefill takes " is"), then gives the model the Triton kernels for a decode
step, which reads that cache and writes its token's K/V into it: its next word is the
reference's (" Paris"), its logits the reference's within bfloat16's rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu_worker import runtime
from gpu_worker.kernels import Kernels
from gpu_worker.protocol import WorkerConfig
from service.tokenizer import Tokenizer
from tests.triton_interpreter import run_interpreted
from tests.worker_fixtures import Chunk, plan_for, sampled

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France?"
ANSWER_START = "The capital of France"
REFERENCE = "attention=torch,layer_ops=torch,matmul=aten"


def prompt_of(model_dir: Path) -> list[int]:
    tokenizer = Tokenizer.from_dir(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    return tokenizer.encode(text + ANSWER_START)


def answer(model_dir: Path, decode_kernels: Kernels | None = None) -> tuple[list[int], list]:
    """The greedy tokens after the prompt, prefilled with the reference kernels and decoded
    with `decode_kernels` (None: the reference's too), and the last step's logits."""
    config = WorkerConfig(
        model_dir=str(model_dir),
        dtype="bfloat16",
        device="cpu",
        block_size=16,
        kv_memory=float(1 << 26),
        max_num_seqs=4,
        kernels=REFERENCE,
        kernel_cache="",
    )
    runner = runtime.start(config)
    prompt = prompt_of(model_dir)
    table = list(range(-(-(len(prompt) + 1) // 16)))
    tokens = sampled(runner.execute(plan_for(runner, [Chunk(0, prompt, 0, table)])))
    if decode_kernels is not None:  # as the model takes them at its start
        model = runner.model
        model.kernels, model.ops = decode_kernels, decode_kernels.layer_ops
        model._pick_functions(zero_centred=False)
    logits = runner.step_logits(plan_for(runner, [Chunk(0, tokens, len(prompt), table)], 1))[0]
    return [*tokens, int(logits.argmax())], logits.tolist()


def interpret(model_dir: str) -> None:
    """In the subprocess: the answer decoded through the Triton kernels, printed."""
    from gpu_worker.attention.triton_backend import INTERPRETED, TritonAttention
    from gpu_worker.triton_layer_ops import TritonLayerOps

    assert INTERPRETED
    triton = Kernels(TritonAttention(), TritonLayerOps(), "aten")
    print(json.dumps(answer(Path(model_dir), triton)))


def test_the_default_model_answers_alike_through_the_triton_kernels(default_model_dir):
    printed = run_interpreted(__name__, str(default_model_dir))
    tokens, logits = json.loads(printed.strip().splitlines()[-1])
    reference, reference_logits = answer(default_model_dir)
    assert tokens == reference
    words = Tokenizer.from_dir(default_model_dir).decode(reference)
    assert words.split()[:2] == ["is", "Paris"], words
    difference = (torch.tensor(logits) - torch.tensor(reference_logits)).abs().max().item()
    largest = max(map(abs, reference_logits))
    print("largest logit difference:", difference, "of", largest)
    # bfloat16: 0.34 of 31.5 measured (the decode kernel sums the keys in its own order)
    assert difference < 0.03 * largest
