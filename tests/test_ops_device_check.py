"""The device check, run quickly on the CPU: it must run unchanged on a GPU host, whose
Python has torch, transformers and numpy but maybe not the service's packages, through
the same code as there wherever a CPU can run it (the agreement sections sharing one
process and its workers, the probes timed over many calls, a decode step taken apart);
each section must be recorded as it ends, whatever the others did, within the run's
deadline; `--requirements` must run without torch; its rooflines must be the larger of a
step's memory and compute times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_worker.model_config import ModelConfig
from ops import (
    device_check,
    device_load,
    device_probes,
    device_report,
    device_sections,
    device_wheels,
)
from ops.device_check import AGREEMENT, SERVICE, Deadline, Section, run_sections
from ops.roofline import Machine, ModelCost

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_GPU_HOSTS = ("orjson", "trio", "quart", "quart_trio", "hypercorn", "structlog")
PINS = ["--kernels", "attention=torch,layer_ops=torch,matmul=aten"]


def without(tmp_path: Path, names: tuple[str, ...]) -> dict[str, str]:
    """An environment whose Pythons cannot import `names`: a module of each name, first on
    the path, that raises ImportError."""
    stubs = tmp_path / "absent"
    stubs.mkdir()
    for name in names:
        (stubs / f"{name}.py").write_text("raise ImportError('not on this host')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), str(ROOT)])}


def without_service_packages(tmp_path: Path) -> dict[str, str]:
    """As on a GPU host."""
    return without(tmp_path, ABSENT_ON_GPU_HOSTS)


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
    served = {s.name for s in device_check.SECTIONS if s.group == device_check.SERVICE}
    assert served == {"serve_http", "interference", "capacity"}
    for name, record in sections.items():
        assert f"## {name}" in table
        assert record["status"] == ("skipped" if name in served else "passed"), name
    for name in served:
        skipped = sections[name]["result"]["skipped"]
        assert skipped.startswith("service dependencies missing: ")
        assert set(skipped.split(": ")[1].split(", ")) == set(ABSENT_ON_GPU_HOSTS)
    assert sections["environment"]["result"]["nvcc"]  # its version, or that it is absent
    probes = sections["flex_probes"]["result"]
    assert len(probes["short_chunks"]) == 4 * 7  # every GQA group at every short length
    assert all(row["flex_us"] > 0 and row["flex_graph_us"] > 0 for row in probes["decode"])
    assert sections["transformers_generate"]["result"]["rows"][0]["cadence_tok_per_s"] > 0
    # The agreement sections ran in one process, and started each worker once between them.
    starts = {s.name: sections[s.name]["result"]["worker_starts"] for s in device_check.SECTIONS}
    assert {name: n for name, n in starts.items() if n} == {
        "decode_timings": 1,
        "logits_vs_transformers": 4,  # Llama and Qwen2 in fp32 and bf16, without graphs
        "mixed_vs_alone": 1,  # with graphs: kept for graphs_on_vs_off, long_prompt, sampler
    }
    # A process's log is named for its first section.
    logs = {path.stem for path in (tmp_path / "out" / "logs").iterdir()}
    grouped = {s.name for s in device_check.SECTIONS if s.group in (AGREEMENT, SERVICE)}
    firsts = {"logits_vs_transformers", "serve_http"}
    assert logs == set(device_check.SECTION_NAMES) - grouped | firsts
    check_decode_timings(sections["decode_timings"]["result"])
    assert "| batch | context | kernels | memcpy_us | attention_us | gemm_us |" in table
    print(f"quick check: {seconds:.0f} s")


def check_decode_timings(timings: dict) -> None:
    """Every row and every part of a decode step's breakdown, as a CPU gives them."""
    steps = [row["step"].split(",")[0].split(":")[0] for row in timings["rows"]]
    assert steps == ["decode", "decode", "mixed", "decode"]
    assert all(row["roofline_ms"] > 0 and row["ms"] > 0 for row in timings["rows"])
    mixed = timings["rows"][2]
    assert (mixed["tokens"], mixed["bucket_tokens"]) == (64 + 4, "eager")  # no graphs on a CPU
    assert timings["kv_memory"]["num_blocks"] > 0
    profiled = timings["decode_profile"]
    assert [row["batch"] for row in profiled] == [1, 4]
    for row in profiled:
        classes = sum(row[f"{name}_us"] for name, _ in device_probes.KERNEL_CLASSES)
        assert row["kernels"] > 0 and row["gemm_us"] > 0
        assert classes + row["other_us"] == pytest.approx(row["busy_us"], abs=0.5)
        assert 0 < row["busy_us"] <= row["span_us"]
    assert {row["batch"] for row in timings["top_kernels"]} == {1, 4}
    (mixed_split,) = timings["mixed_profile"]
    assert (mixed_split["chunk"], mixed_split["decoders"]) == (64, 4)
    assert mixed_split["kernels"] > 0 and mixed_split["gemm_us"] > 0
    assert 0 < mixed_split["busy_us"] <= mixed_split["span_us"]
    for row in timings["host_before_replay"]:
        assert row["inputs_us"] > 0 and row["staging_us"] > 0 and row["launch_us"] > 0
    for row in timings["floors"]:
        floors = ("gemm_graph_us", "gemm_as_served_graph_us", "sdpa_graph_us")
        assert all(row[key] > 0 for key in (*floors, "weight_floor_us", "kv_floor_us"))
    trials = timings["kernel_trials"]
    assert {row["seam"] for row in trials} == {"attention", "layer_ops", "matmul"}
    assert all(row["chosen"] for row in trials)  # pinned: one candidate each
    for row in timings["row_sizes"]:  # each weight shape's check: what it kept, what not
        kept, dropped = row["kept"].split(), row["dropped"].split()
        assert row["kernel"] == "aten" and kept and not set(kept) & set(dropped)
    assert timings["row_sizes"]


def test_the_service_answers_then_keeps_its_promise_under_load(tmp_path):
    """serve_http, interference and capacity in one process, on one server it stops
    gracefully after the last of them."""
    done = check(tmp_path, "--only", "serve_http", "interference", "capacity")
    assert done.returncode == 0, done.stdout[-4000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    sections = report["sections"]
    assert [sections[name]["status"] for name in ("serve_http", "interference", "capacity")] == [
        "passed"
    ] * 3
    served = sections["serve_http"]["result"]
    assert (served["status"], served["completion_tokens"]) == (200, 8)
    assert served["healthy_s"] > 0 and "exit_code" not in served  # kept for the others
    check_interference(sections["interference"]["result"], device_load.QUICK_INTERFERENCE)
    check_capacity(sections["capacity"]["result"], device_load.QUICK_CAPACITY)
    assert sections["capacity"]["result"]["exit_code"] == 0  # stopped gracefully
    table = (tmp_path / "out" / "report.md").read_text()
    assert "| policy | worst_gap_ms | itl_p99_ms | itl_p50_ms | decode_step_ms |" in table
    assert "| rate_req_per_s | requests | failed | attainment |" in table


def check_interference(found: dict, load: device_load.InterferenceLoad) -> None:
    """Both policies ran on the server (each has worker steps in the server's log under its
    name), every prompt was answered while every stream decoded, and the gaps add up."""
    assert [row["policy"] for row in found["policies"]] == ["fcfs", "stall_free"]
    for row in found["policies"]:
        assert row["worst_gap_ms"] >= row["itl_p50_ms"] > 0
        assert row["itl_p99_ms"] >= row["itl_p50_ms"] and row["decode_step_ms"] > 0
        ratio = row["worst_gap_ms"] / row["decode_step_ms"]
        assert row["worst_gap_over_step"] == pytest.approx(ratio, rel=0.01)  # of rounded ms
        assert row["worker_decode_step_ms"] > 0 and row["worker_largest_prefill_step_ms"] > 0
    prompts = [(row["policy"], row["prompt_tokens"]) for row in found["prompt_rows"]]
    assert prompts == [(policy, n) for policy in ("fcfs", "stall_free") for n in load.prompts]
    for row in found["prompt_rows"]:
        assert row["ttft_ms"] > 0 and row["streams_active"] == load.streams
        assert row["gap_max_ms"] >= row["gap_p99_ms"] > 0
    longest = found["prompt_rows"][-1]
    assert found["stall_free_gap_over_step"] == longest["gap_max_over_step"]
    assert found["bar"] == 2  # the issue's: stall_free's worst gap at most 2 decode steps
    assert found["meets_bar"] == (longest["gap_max_over_step"] <= 2)


def check_capacity(found: dict, load: device_load.CapacityLoad) -> None:
    rates = found["rates"]
    assert [row["rate_req_per_s"] for row in rates] == list(load.rates)
    for row in rates:
        assert row["requests"] > 0 and row["failed"] == 0
        assert 0 <= row["attainment"] <= 1 and row["ttft_p50_ms"] > 0
        met_per_s = row["attainment"] * row["requests"] / load.duration_s
        assert row["goodput_req_per_s"] == pytest.approx(met_per_s, abs=0.01)
    assert found["capacity_req_per_s"] in (None, *load.rates)
    assert found["itl_p99_ms"] == load.itl_p99_ms and found["policy"] == "stall_free"


def test_missing_service_packages_are_a_failure_once_wheels_are_given(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = without_service_packages(tmp_path)
    done = check(tmp_path, "--only", "serve_http", "--wheels", str(wheels), env=env)
    assert done.returncode == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["sections"]["serve_http"]["status"] == "failed"


def test_the_wheels_hold_the_service_dependencies_but_never_the_hosts_torch():
    requirements = device_wheels.service_requirements()
    names = {device_wheels.distribution(r) for r in requirements}
    assert {"trio", "quart-trio", "orjson", "structlog", "tokenizers", "httpx"} <= names
    assert not names & {"torch", "numpy"}
    command = device_wheels.install_command(Path("/wheels"))
    assert command[command.index("--find-links") + 1] == "/wheels"
    assert "--no-index" in command and command[-len(requirements) :] == requirements


def test_the_requirements_are_listed_on_a_host_without_torch(tmp_path):
    command = [sys.executable, "-m", "ops.device_check", "--requirements"]
    env = without(tmp_path, ("torch",))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == device_wheels.service_requirements()


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
    sections = [Section(name, 1, name) for name in bodies]
    started = time.monotonic()
    report = run_sections(
        sections,
        lambda batch: fake_section(bodies[batch[0].name]),
        tmp_path,
        {"device": "cpu", "sections": {}},
        lambda section: 1 if section.name == "hangs" else 30,
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


# A group's process: each section's result in turn, "b" hanging, then a slow exit.
GROUP_PROCESS = """
import json, os, sys, time
out, names = sys.argv[1], sys.argv[2:]
print("process of", *names, flush=True)
for name in names:
    if name == "b":
        time.sleep(60)
    with open(os.path.join(out, "sections", name + ".json"), "w") as f:
        json.dump({"ok": True, "pid": os.getpid()}, f)
time.sleep(60)
"""


def test_a_group_shares_a_process_and_the_sections_after_a_hang_run_in_a_fresh_one(tmp_path):
    sections = [Section(name, 1, name, group="g") for name in "abcd"]
    commands = []

    def command_of(batch: list[Section]) -> list[str]:
        commands.append([s.name for s in batch])
        return [sys.executable, "-c", GROUP_PROCESS, str(tmp_path), *commands[-1]]

    report = run_sections(
        sections, command_of, tmp_path, {"device": "cpu", "sections": {}}, lambda section: 2
    )
    records = report["sections"]
    assert commands == [["a", "b", "c", "d"], ["c", "d"]]
    assert {name: r["status"] for name, r in records.items()} == {
        "a": "passed",
        "b": "timed out",
        "c": "passed",
        "d": "passed (slow exit)",  # its result written, its process killed at its timeout
    }
    pids = {name: r["result"]["pid"] for name, r in records.items() if r["result"]}
    assert pids["c"] == pids["d"] != pids["a"]
    assert records["b"]["tail"] == "process of a b c d"
    assert report["passed"] is False


def test_a_section_process_exits_at_once_its_output_flushed_and_no_teardown_run():
    body = (
        "import atexit, sys; atexit.register(print, 'teardown')\n"
        "from ops.device_check import exit_now\n"
        "sys.stdout.write('result written'); exit_now(3)"
    )
    done = subprocess.run(
        [sys.executable, "-c", body], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (3, "result written")


def test_the_deadline_cuts_a_sections_timeout_and_skips_those_it_leaves_no_time(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(device_check, "MIN_SECTION_S", 1)
    sections = [Section("slow", 100, "slow"), Section("next", 1, "next")]
    hang = "import time; time.sleep(60)"
    started = time.monotonic()
    report = run_sections(
        sections,
        lambda batch: fake_section(hang),
        tmp_path,
        {"device": "cpu", "sections": {}},
        deadline=Deadline.after(2.5),
    )
    assert time.monotonic() - started < 10
    slow, skipped = report["sections"]["slow"], report["sections"]["next"]
    assert (slow["status"], slow["timeout_s"]) == ("timed out", 2)
    assert slow["note"] == "timeout cut from 150 s to 2 s by the run's deadline"
    assert (skipped["status"], skipped["ok"]) == ("skipped (deadline)", False)
    assert "skipped (deadline)" in (tmp_path / "report.md").read_text()


def test_a_section_that_raises_records_its_traceback(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("no device")

    monkeypatch.setattr(device_sections, "machine", broken)
    args = device_check.parser().parse_args([str(tmp_path), "--device", "cpu", "--quick"])
    args.out_dir, args.work = tmp_path, tmp_path / "work"
    (tmp_path / "sections").mkdir()
    assert device_check.run_child(["machine"], args) == 1
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
    row = device_probes.timing_row(
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


def test_the_full_runs_sections_fit_its_deadline_each_with_half_its_time_again_to_spare():
    sections = device_check.SECTIONS
    assert sum(section.expected_s for section in sections) <= 0.8 * device_check.DEADLINE_S
    assert all(section.timeout_s >= 1.5 * section.expected_s for section in sections)


def test_kernels_are_split_by_class_with_their_busy_time_beside_their_span():
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
        "nvjet_hsh_64x8_64x16_2x1_v_bz_coopA_NTN": "gemm",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4>": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma": "attention",
        "_partition_kernel": "attention",
        "triton_tem_fused_flex_attention_0": "attention",
        "void at::native::vectorized_elementwise_kernel<8, FillFunctor>": "elementwise",
        "triton_per_fused_add_mean_mul_pow_rsqrt_0": "elementwise",
        "Memcpy HtoD (Pageable -> Device)": "memcpy",
        "ncclDevKernel_Broadcast_RING_LL": "other",
    }
    assert {name: device_probes.kernel_class(name) for name in names} == names
    gemm, merge = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "_merge_kernel"
    Kernel = device_probes.Kernel
    kernels = [Kernel(gemm, 0, 10, 10), Kernel(merge, 15, 20, 5), Kernel(gemm, 30, 40, 10)]
    split = device_probes.kernel_split(kernels)
    assert (split["kernels"], split["gemm_us"], split["attention_us"]) == (3, 20, 5)
    assert (split["busy_us"], split["span_us"]) == (25, 40)  # the GPU idle 15 µs of 40
