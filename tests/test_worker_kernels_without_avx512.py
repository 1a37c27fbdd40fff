"""The C++ kernels built for a CPU without AVX-512 (CADENCE_NATIVE_MARCH=x86-64-v3) still
agree with the PyTorch reference: their scalar fallbacks are what such a CPU runs.

A separate process: the build for another instruction set is another library, and a
process loads one (the first build takes a minute and is cached like the native one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECKS = """
import json, torch
from gpu_worker import kernel_choice, kernels, native
from gpu_worker.attention import TorchAttention
torch.set_num_threads(1)
assert native.MARCH == "x86-64-v3" and native.kernels() is not None
cpu = torch.device("cpu")
found = {}
for dtype, cache in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                     (torch.bfloat16, torch.int8), (torch.float32, torch.float8_e4m3fn)):
    shapes = kernel_choice.Shapes(9, 3, 64, 576, 1536, 16, dtype, cpu, cache)
    case = kernel_choice.attention_case(shapes, batch=4, chunk=40, start=70)
    reference = TorchAttention()
    expected = (
        kernel_choice.run_decode(reference, case), kernel_choice.run_prefill(reference, case)
    )
    key = f"{dtype}/{cache}"
    for backend in kernels.attention_candidates(cpu, dtype, 64):
        found[f"{key} attention {backend.name}"] = kernel_choice.check_attention(
            backend, case, expected
        )
    ops, trials = kernel_choice.choose_layer_ops(kernels.layer_ops_candidates(cpu), shapes)
    for trial in trials:
        found[f"{key} layer_ops {trial.name}"] = trial.failed or None
print(json.dumps(found))
"""


def test_every_candidate_built_without_avx512_matches_the_reference():
    env = {**os.environ, "CADENCE_NATIVE_MARCH": "x86-64-v3", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # Without AVX512-BF16 the chunk kernel is not registered: native-rows and hybrid serve.
    assert not any(name.endswith("attention native") for name in found)
    assert sum(" attention native-rows" in name for name in found) == 4
    assert {name: failure for name, failure in found.items() if failure} == {}
