"""The worker's exactness claims, checked as other kinds of CPU would run them.

oneDNN picks its kernels (and so each output's order of summation) by ISA, shape, thread
count and cache sizes, and the C++ kernels are built for the CPU they run on: what holds on
the machine that runs the suite may not hold on the next. This machine can be made to
look like others: ONEDNN_MAX_CPU_ISA caps the instructions oneDNN may use,
ATEN_CPU_CAPABILITY PyTorch's own kernels', CADENCE_NATIVE_MARCH the C++ kernels', and
OMP_NUM_THREADS the threads. Under each cap, on one thread (the rest of the suite runs on
two), the row-invariance (on the real model), matmul and kernel-choice tests run again,
unchanged, in a fresh interpreter (the caps are read at start-up), but for those whose
claim is the code's logic (LOGIC_ONLY). The real model's agreement with transformers
(tests/test_worker_real_model.py) is not among them: under a cap it checks the library's
arithmetic more than cadence's claims, for a minute of CI.
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
CLAIMS = [  # run again, but for LOGIC_ONLY
    "tests/test_worker_linear.py",
    "tests/test_worker_batch_invariance.py",
    "tests/test_worker_kernel_choice.py",
]
# Tests of these files whose claim is the code's logic, not the arithmetic of this CPU's
# kernels (fake kernels, hypothesis over call sizes, the chooser's rules, cache and pins,
# the handshake's report): the suite runs them once, uncapped; under a cap they would pass
# or fail alike, for a fifth of each capped run.
LOGIC_ONLY = {
    "tests/test_worker_linear.py": [
        "test_the_calls_cover_each_row_once_in_checked_sizes",
        "test_sizes_whose_kernel_sums_otherwise_are_left_out",
        "test_sizes_whose_rows_depend_on_their_position_are_left_out",
        "test_sizes_whose_bits_change_with_the_thread_count_are_left_out",
        "test_a_row_has_its_bits_at_any_row_count_whatever_the_library_does",
        "test_without_the_checked_sizes_the_fake_library_would_differ",
        "test_the_native_kernel_gives_way_where_it_cannot_take_the_weight",
    ],
    "tests/test_worker_kernel_choice.py": [
        "test_a_wrong_candidate_fails_its_check",
        "test_a_candidate_whose_rows_depend_on_their_company_fails_the_invariance_check",
        "test_row_invariance_is_held_on_other_shapes_too",
        "test_the_chooser_skips_the_fastest_candidate_when_it_fails_its_check",
        "test_the_matmul_wins_that_is_fastest_over_a_lone_row_a_batch_and_a_chunk_alike",
        "test_pick_takes_the_fastest_passing_candidate_and_preferred_ones_first",
        "test_the_choice_is_cached_per_machine_and_shapes",
        "test_a_cached_choice_that_is_no_longer_offered_or_a_broken_cache_is_measured_again",
        "test_pins_parse_and_bind",
        "test_the_cli_refuses_bad_pins",
        "test_the_handshake_reports_the_choice",
        "test_the_cache_is_written_through_a_name_nobody_can_plant",
    ],
}
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
    for file, tests in LOGIC_ONLY.items():  # a renamed test would run again, unnoticed
        text = (ROOT / file).read_text()
        assert not [test for test in tests if f"def {test}(" not in text], file
        command += [f"--deselect={file}::{test}" for test in tests]
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
