"""What a non-editable install carries: every file the C++ kernels are built from. A header
left out of package-data builds nowhere but in a checkout, and the worker then falls back
to the PyTorch kernels with only a log line to say so."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from gpu_worker import native

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def packaged(package: str) -> set[Path]:
    """The files pyproject.toml's package-data globs select in `package`."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = settings["tool"]["setuptools"]["package-data"][package]
    return {path.resolve() for pattern in patterns for path in (ROOT / package).glob(pattern)}


def built_from(sources: list[Path]) -> set[Path]:
    """The sources and every file they #include "...", transitively."""
    needed = {source.resolve() for source in sources}
    pending = list(needed)
    while pending:
        source = pending.pop()
        for name in INCLUDE.findall(source.read_text()):
            header = (source.parent / name).resolve()
            if header not in needed:
                needed.add(header)
                pending.append(header)
    return needed


def test_the_package_data_carries_every_kernel_source_and_header():
    needed = built_from(native.SOURCES)
    assert {path.suffix for path in needed} == {".cpp", ".h"}  # the headers were found
    assert sorted(str(p.relative_to(ROOT)) for p in needed - packaged("gpu_worker")) == []
