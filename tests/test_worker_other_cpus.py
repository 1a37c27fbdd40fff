"""The worker's exactness claims, checked as other kinds of CPU would run them.

oneDNN picks its kernels (and so each output's order of summation) by ISA, shape, thread
count and cache sizes, and the C++ kernels are built for the CPU they run on: what holds on
the machine that runs the suite may not hold on the next. This machine can be made to
look like others: ONEDNN_MAX_CPU_ISA caps the instructions oneDNN may use,
ATEN_CPU_CAPABILITY PyTorch's own kernels', CADENCE_NATIVE_MARCH the C++ kernels', and
OMP_NUM_THREADS the threads. Under each cap, on one thread (the rest of the suite runs on
two), the row-invariance (on the real model), matmul and kernel-choice tests run again,
unchanged, in a fresh interpreter (the caps are read at start-up). The real model's
agreement with transformers (tests/test_worker_real_model.py) is not among them: under a
cap it checks the library's arithmetic more than cadence's claims, for a minute of CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import default_cache_dir

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parent.parent
CLAIMS = [
    "tests/test_worker_linear.py",
    "tests/test_worker_batch_invariance.py",
    "tests/test_worker_kernel_choice.py",
]
KINDS = {
    # oneDNN without AVX512-BF16 (bfloat16 matmuls through other kernels).
    "avx512-core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    # A CPU without AVX-512: oneDNN, PyTorch and the C++ kernels all on AVX2.
    "no-avx512": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "CADENCE_NATIVE_MARCH": "x86-64-v3",
    },
}


def test_the_exactness_claims_hold_on_other_kinds_of_cpu(tmp_path):
    """Both kinds at once, each on one thread (the rest of the suite runs on every core),
    so that the two runs share the machine's cores instead of taking turns."""
    # The model converted once, in the cache the rest of the suite uses.
    cache = os.environ.get("CADENCE_CACHE") or str(default_cache_dir())
    command = [sys.executable, "-m", "pytest", *CLAIMS, "-q", "-x", "-p", "no:cacheprovider"]
    runs = {}
    for kind, caps in KINDS.items():
        env = {**os.environ, **caps, "OMP_NUM_THREADS": "1"}
        env.update(PYTHONPATH=str(ROOT), CADENCE_CACHE=cache)
        output = (tmp_path / f"{kind}.log").open("w")
        runs[kind] = (
            subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output),
            output,
        )
    failed = {}
    for kind, (process, output) in runs.items():
        returncode = process.wait(timeout=900)
        output.close()
        if returncode != 0:
            failed[kind] = (tmp_path / f"{kind}.log").read_text()[-6000:]
    assert not failed, "\n".join(f"under {KINDS[k]}:\n{log}" for k, log in failed.items())
