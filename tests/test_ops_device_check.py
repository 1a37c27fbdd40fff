"""The prepared GPU smoke run, run quickly on the CPU: it must run unchanged on the first
GPU host, whose Python has torch, transformers and numpy but not the service's packages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ops import gpu_smoke

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_GPU_HOSTS = ("orjson", "trio", "quart", "quart_trio", "hypercorn", "structlog")


def test_the_quick_smoke_run_writes_every_section_without_the_service_packages(tmp_path):
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in ABSENT_ON_GPU_HOSTS)
    args = [str(tmp_path), "--device", "cpu", "--quick"]
    args += ["--kernels", "attention=torch,layer_ops=torch,matmul=aten"]
    code = f"import sys; {blocked}; from ops.gpu_smoke import main; sys.exit(main({args!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is True
    table = (tmp_path / "report.md").read_text()
    for name in ("environment", *gpu_smoke.SECTIONS):
        assert name in report
        assert f"## {name}" in table
    rows = report["timings"]["rows"]
    assert [row["step"].split(",")[0].split(":")[0] for row in rows] == [
        "decode",
        "decode",
        "mixed",
        "decode",
    ]
    assert all(row["roofline_ms"] > 0 and row["ms"] > 0 for row in rows)
    assert report["timings"]["kv_memory"]["num_blocks"] > 0


def test_a_failing_section_is_reported_and_fails_the_run():
    class Broken(gpu_smoke.Smoke):
        def __init__(self) -> None:
            self.device = "cpu"

    report = gpu_smoke.run(Broken())
    assert report["passed"] is False
    assert "Traceback" in report["timings"]["error"]
    assert "## timings" in gpu_smoke.markdown(report)
