"""What a GPU host must be given for the device check's service sections (`serve_http`,
`interference`, `capacity`): the service's dependencies less the host's own torch and
numpy, and the pip command that installs them from a folder of wheels. Standard library
only: `python -m ops.device_check --requirements` prints the list on a host without
torch."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from ops.device_report import ROOT

HOST_PACKAGES = {"torch", "numpy"}  # on every GPU host; a second copy would shadow its own


def service_requirements() -> list[str]:
    """pyproject.toml's dependencies, less the GPU host's own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [r for r in project["dependencies"] if distribution(r) not in HOST_PACKAGES]


def distribution(requirement: str) -> str:
    """The distribution a requirement names, lower-cased: "quart-trio>=0.11" -> "quart-trio"."""
    match = re.match(r"[A-Za-z0-9_.\-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower()


def install_command(wheels: Path, breaking_system_packages: bool = False) -> list[str]:
    """pip installing the service's dependencies from `wheels` only, into this Python."""
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    command += ["--disable-pip-version-check", "--no-warn-script-location"]
    if breaking_system_packages:  # a distribution's own Python (PEP 668) on a lent machine
        command.append("--break-system-packages")
    return command + service_requirements()
