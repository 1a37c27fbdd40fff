"""Triton kernels on the CPU, through Triton's interpreter, for the tests of cadence's own
kernels (attention, the varlen prefill, the layer ops).

The interpreter takes over only where TRITON_INTERPRET=1 is set before a kernel is
decorated, that is before its module is imported; the tests' own process imports the
modules without it (to read constants and build inputs). So a test module defines
`interpret(*args)`, which runs its kernels and saves or prints their outputs, and runs it
here in a subprocess; the comparisons happen in the test's process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def run_interpreted(module: str, *args: str, timeout: int = 300) -> str:
    """`module`'s interpret(*args) under the interpreter; what it printed."""
    command = f"import sys; from {module} import interpret; interpret(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", command, *args],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def interpreted_outputs(module: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """What `module`'s interpret(path) saved to `path` with torch.save."""
    path = tmp_path_factory.mktemp("triton") / "outputs.pt"
    run_interpreted(module, str(path))
    return torch.load(path, weights_only=False)
