"""The device check, run quickly on the CPU: it must run unchanged on the first GPU host,
whose Python has torch, transformers and numpy but maybe not the service's packages; each
section must be recorded as it ends, whatever the others did; its rooflines must be the
larger of a step's memory and compute times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_worker.model_config import ModelConfig
from ops import device_check, device_report, device_sections, device_serve
from ops.device_check import Section, run_sections
from ops.roofline import Machine, ModelCost

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_GPU_HOSTS = ("orjson", "trio", "quart", "quart_trio", "hypercorn", "structlog")
PINS = ["--kernels", "attention=torch,layer_ops=torch,matmul=aten"]


def without_service_packages(tmp_path: Path) -> dict[str, str]:
    """An environment whose Pythons cannot import the service's packages, as on a GPU
    host: a module of each name, first on the path, that raises ImportError."""
    stubs = tmp_path / "absent"
    stubs.mkdir()
    for name in ABSENT_ON_GPU_HOSTS:
        (stubs / f"{name}.py").write_text("raise ImportError('not on this GPU host')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), str(ROOT)])}


def check(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    command = [sys.executable, "-m", "ops.device_check", str(tmp_path / "out")]
    command += ["--device", "cpu", "--quick", "--work", str(tmp_path / "work"), *PINS, *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_quick_check_runs_every_section_on_a_cpu_without_the_service_packages(tmp_path):
    started = time.monotonic()
    done = check(tmp_path, env=without_service_packages(tmp_path))
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-4000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["passed"] is True
    sections = report["sections"]
    assert list(sections) == list(device_check.SECTION_NAMES)
    table = (tmp_path / "out" / "report.md").read_text()
    for name, record in sections.items():
        assert f"## {name}" in table
        assert record["status"] == ("skipped" if name == "serve_http" else "passed"), name
    skipped = sections["serve_http"]["result"]["skipped"]
    assert skipped.startswith("service dependencies missing: ")
    assert set(skipped.split(": ")[1].split(", ")) == set(ABSENT_ON_GPU_HOSTS)
    timings = sections["decode_timings"]["result"]
    steps = [row["step"].split(",")[0].split(":")[0] for row in timings["rows"]]
    assert steps == ["decode", "decode", "mixed", "decode"]
    assert all(row["roofline_ms"] > 0 and row["ms"] > 0 for row in timings["rows"])
    assert timings["kv_memory"]["num_blocks"] > 0
    probes = sections["flex_probes"]["result"]
    assert len(probes["short_chunks"]) == 4 * 7  # every GQA group at every short length
    assert sections["transformers_generate"]["result"]["rows"][0]["cadence_tok_per_s"] > 0
    print(f"quick check: {seconds:.0f} s")


def test_the_service_answers_a_chat_completion_over_http(tmp_path):
    done = check(tmp_path, "--only", "serve_http")
    assert done.returncode == 0, done.stdout[-4000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    served = report["sections"]["serve_http"]
    assert served["status"] == "passed"
    assert served["result"]["status"] == 200
    assert served["result"]["completion_tokens"] == 8
    assert served["result"]["exit_code"] == 0  # stopped gracefully


def test_missing_service_packages_are_a_failure_once_wheels_are_given(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = without_service_packages(tmp_path)
    done = check(tmp_path, "--only", "serve_http", "--wheels", str(wheels), env=env)
    assert done.returncode == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["sections"]["serve_http"]["status"] == "failed"


def test_the_wheels_hold_the_service_dependencies_but_never_the_hosts_torch():
    requirements = device_serve.service_requirements()
    names = {device_serve._distribution(r) for r in requirements}
    assert {"trio", "quart-trio", "orjson", "structlog", "tokenizers", "httpx"} <= names
    assert not names & {"torch", "numpy"}
    command = device_serve.install_command(Path("/wheels"))
    assert command[command.index("--find-links") + 1] == "/wheels"
    assert "--no-index" in command and command[-len(requirements) :] == requirements


def fake_section(body: str) -> list[str]:
    return [sys.executable, "-c", body]


def test_every_section_is_recorded_as_it_ends_whatever_the_ones_before_did(tmp_path):
    def result(name: str) -> str:
        return str(device_report.result_path(tmp_path, name))

    bodies = {
        "raises": "raise RuntimeError('boom')",
        "hangs": "import time; print('started', flush=True); time.sleep(60)",
        "fails": f"import json; json.dump({{'ok': False, 'rows': [{{'a': 1}}]}}, "
        f"open({result('fails')!r}, 'w')); raise SystemExit(1)",
        # It sees the report as the runner left it when it started.
        "checks": "import json\n"
        f"report = json.load(open({str(tmp_path / 'report.json')!r}))\n"
        "seen = {name: r['status'] for name, r in report['sections'].items()}\n"
        f"json.dump({{'ok': True, 'seen': seen}}, open({result('checks')!r}, 'w'))\n",
    }
    sections = [Section(name, 1 if name == "hangs" else 30, name) for name in bodies]
    started = time.monotonic()
    report = run_sections(
        sections,
        lambda section: fake_section(bodies[section.name]),
        tmp_path,
        {"device": "cpu", "sections": {}},
    )
    assert time.monotonic() - started < 30  # the hang was cut at its timeout
    records = report["sections"]
    assert records["raises"]["status"] == "crashed (exit 1)"
    assert "RuntimeError: boom" in records["raises"]["tail"]
    assert records["hangs"]["status"] == "timed out"
    assert records["hangs"]["tail"] == "started"  # its output up to the kill
    assert records["fails"]["status"] == "failed"
    assert records["checks"]["status"] == "passed"
    assert records["checks"]["result"]["seen"] == {
        "raises": "crashed (exit 1)",
        "hangs": "timed out",
        "fails": "failed",
        "checks": "running",
    }
    assert report["passed"] is False
    assert json.loads((tmp_path / "report.json").read_text())["sections"] == records
    table = (tmp_path / "report.md").read_text()
    assert all(f"## {name}" in table for name in bodies)
    assert (tmp_path / "logs" / "hangs.log").read_text() == "started\n"


def test_a_section_that_raises_records_its_traceback(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("no device")

    monkeypatch.setattr(device_sections, "machine", broken)
    args = device_check.parser().parse_args([str(tmp_path), "--device", "cpu", "--quick"])
    args.out_dir, args.work = tmp_path, tmp_path / "work"
    (tmp_path / "sections").mkdir()
    assert device_check.run_child("machine", args) == 1
    found = json.loads(device_report.result_path(tmp_path, "machine").read_text())
    assert found["ok"] is False
    assert "RuntimeError: no device" in found["error"]


def test_the_exit_code_says_whether_every_check_passed(tmp_path):
    args = ["--only", "environment", "--work", str(tmp_path / "work")]
    assert device_check.main([str(tmp_path), "--device", "cpu", *args]) == 0
    # A CUDA check on a host without CUDA fails its first section; the report keeps both runs.
    assert device_check.main([str(tmp_path), "--device", "cuda", *args]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["sections"]["environment"]["status"] == "failed"
    assert report["passed"] is False


LLAMA_1B = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "vocab_size": 32000,
    }
)


@pytest.mark.parametrize("bound", ["memory", "compute"])
def test_a_mixed_steps_roofline_is_the_larger_of_its_memory_and_compute_times(bound):
    cost = ModelCost.of(LLAMA_1B)
    machine = Machine(4e12, 1e16) if bound == "memory" else Machine(4e12, 1e13)
    chunk, decoders, context = 512, 64, 1024
    kv_tokens, pairs = chunk + decoders * context, chunk * (chunk + 1) // 2 + decoders * context
    row = device_sections.timing_row(
        "mixed", 10.0, cost, machine,
        tokens=chunk + decoders, kv_tokens=kv_tokens, attention_pairs=pairs, decoded=decoders,
    )  # fmt: skip
    memory_ms = (cost.weight_bytes + kv_tokens * cost.kv_bytes_per_token) / 4e12 * 1e3
    flops = (chunk + decoders) * cost.flops_per_token + pairs * cost.attention_flops_per_pair
    compute_ms = flops / machine.matmul_flops * 1e3
    assert row["memory_ms"] == pytest.approx(memory_ms, rel=1e-3)
    assert row["compute_ms"] == pytest.approx(compute_ms, rel=1e-3)
    assert row["roofline_ms"] == pytest.approx(max(memory_ms, compute_ms), rel=1e-3)
    larger = memory_ms if bound == "memory" else compute_ms
    assert row["roofline_ms"] == pytest.approx(larger, rel=1e-3)
    assert row["roofline_ratio"] == pytest.approx(larger / 10.0, rel=1e-3)
    assert row["decoded_tok_per_s"] == pytest.approx(decoders / 10.0 * 1000)


def test_the_full_runs_timeouts_fit_the_device_budget():
    assert sum(section.timeout_s for section in device_check.SECTIONS) <= 450  # 7.5 minutes
