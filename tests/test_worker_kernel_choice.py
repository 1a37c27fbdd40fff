"""Choosing kernels by measuring them: every candidate against the PyTorch reference, the
chooser's rules, its cache, and pins."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from gpu_worker import kernel_choice, kernels
from gpu_worker.attention import (
    FULL,
    LayerAttention,
    NativeAttention,
    NativeRowsAttention,
    TorchAttention,
)
from gpu_worker.kernel_choice import NoCorrectKernel, Shapes, Trial, pick, wall_timer
from gpu_worker.layer_ops import TorchLayerOps, silu_and_mul
from gpu_worker.protocol import parse_kernel_pins
from service.cli import build_parser
from tests.worker_fixtures import make_runner

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float32]


def case_and_expected(shapes: Shapes) -> tuple[kernel_choice.AttentionCase, tuple]:
    case = kernel_choice.attention_case(shapes)
    reference = TorchAttention()
    return case, (
        kernel_choice.run_decode(reference, case),
        kernel_choice.run_prefill(reference, case),
    )


def smollm_shapes(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> Shapes:
    """The default model's shapes: 9 heads over 3 kv heads of 64, hidden 576."""
    return Shapes(9, 3, 64, 576, 1536, 16, dtype, CPU, cache_dtype or dtype)


class ZeroAttention(NativeRowsAttention):
    """The fastest kernel of all, and wrong: it never reads the cache."""

    name = "zeros"

    def decode(self, q, kv, group):
        return torch.zeros_like(q)

    def prefill(self, q, k, v, kv, chunk):
        return torch.zeros_like(q)


class CompanyDependentAttention(NativeRowsAttention):
    """Within float tolerance of the reference, but a row's bits depend on its batch."""

    name = "company"

    def decode(self, q, kv, group):
        out = super().decode(q, kv, group)
        return out + 1e-3 * (q.shape[0] > 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_every_attention_candidate_offered_here_matches_the_reference(dtype, cache_dtype):
    """On 8-bit caches too, where the native kernels keep their rows invariant."""
    shapes = smollm_shapes(dtype, cache_dtype)
    offered = kernels.attention_candidates(CPU, dtype, shapes.head_dim)
    names = [backend.name for backend in offered]
    expected_names = ["torch", "native-rows", "hybrid"]
    # The bfloat16 chunk kernel is built where the CPU (or CADENCE_NATIVE_MARCH) has AVX512-BF16.
    chunk_kernel = NativeAttention.serves(CPU, dtype, shapes.head_dim)
    assert names == expected_names + (["native"] if chunk_kernel else [])
    if dtype == torch.bfloat16 and "avx512_bf16" in kernels.native.cpu_flags():
        assert chunk_kernel or kernels.native.MARCH != "native"
    case, expected = case_and_expected(shapes)
    assert expected[0].abs().max() > 0.1 and expected[1].abs().max() > 0.1
    for backend in offered:
        assert kernel_choice.check_attention(backend, case, expected) is None, backend.name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_every_layer_ops_and_matmul_candidate_passes_its_check(dtype, cache_dtype):
    shapes = smollm_shapes(dtype, cache_dtype)
    ops, ops_trials = kernel_choice.choose_layer_ops(kernels.layer_ops_candidates(CPU), shapes)
    offered = kernels.matmul_candidates(CPU, dtype)
    matmul, matmul_trials = kernel_choice.choose_matmul(offered, shapes)
    assert [t.name for t in ops_trials] == ["torch", "native"]
    # cadence's bfloat16 matmul is built where the CPU (or CADENCE_NATIVE_MARCH) has AVX512-BF16
    bf16_kernel = hasattr(kernels.native.kernels(), "bf16_matmul")
    native = ["native"] if dtype == torch.bfloat16 and bf16_kernel else []
    assert [t.name for t in matmul_trials] == ["aten", "onednn", *native]
    assert all(t.ms is not None and t.ms > 0 for t in ops_trials + matmul_trials)
    assert ops.name == min(ops_trials, key=lambda t: t.ms).name
    assert matmul in offered


def test_the_matmul_wins_that_is_fastest_over_a_lone_row_a_batch_and_a_chunk_alike(
    monkeypatch,
):
    """Twice as fast on a lone decode row and 5% slower on a prefill chunk beats the
    other, though its summed time is the larger: each workload weighs by its fastest."""
    ms = {  # by rows: the candidates' times
        1: {"aten": 0.10, "onednn": 0.05},
        64: {"aten": 1.00, "onednn": 1.00},
        256: {"aten": 4.00, "onednn": 4.20},
    }

    def timed(candidates, name, check, workload, **kwargs):
        rows = workload.keywords["rows"]
        trials = [kernel_choice.Trial(c, ms[rows][c]) for c in candidates]
        return min(candidates, key=ms[rows].__getitem__), trials

    monkeypatch.setattr(kernel_choice, "pick", timed)
    shapes = smollm_shapes(torch.float32)
    matmul, trials = kernel_choice.choose_matmul(["aten", "onednn"], shapes)
    assert matmul == "onednn"
    assert {t.name: t.ms for t in trials} == {"aten": 5.1, "onednn": 5.25}


def test_a_wrong_candidate_fails_its_check():
    shapes = smollm_shapes(torch.bfloat16)
    case, expected = case_and_expected(shapes)
    failure = kernel_choice.check_attention(ZeroAttention(None), case, expected)
    assert failure is not None and failure.startswith("decode differs from the reference")


def test_a_candidate_whose_rows_depend_on_their_company_fails_the_invariance_check():
    shapes = smollm_shapes(torch.bfloat16)
    case, expected = case_and_expected(shapes)
    backend = CompanyDependentAttention(kernels.native.kernels())
    assert kernel_choice.check_attention(backend, case, expected) == (
        "decode row 0 alone differs from the same row in a batch"
    )


class WindowlessAttention(NativeRowsAttention):
    """Claims sliding windows, and attends over the whole context."""

    name = "windowless"

    def decode(self, q, kv, group):
        return self._decode_rows(q, kv, group.block_tables, group.context_lens, FULL)


def test_a_windowed_model_is_offered_and_checked_on_what_serves_windows():
    layers = (LayerAttention(window=4096), FULL)  # Gemma 3's local and global layers
    offered = kernels.attention_candidates(CPU, torch.bfloat16, 64, layers)
    assert {b.name for b in offered} == {"torch", "native-rows", "hybrid"}  # no chunk kernel
    capped = kernels.attention_candidates(CPU, torch.bfloat16, 64, (LayerAttention(softcap=50),))
    assert {b.name for b in capped} == {"torch", "native-rows", "hybrid"}  # Gemma 2's
    shapes = Shapes(9, 3, 64, 576, 1536, 16, torch.bfloat16, CPU, torch.bfloat16, layers)
    # Checked where the window bites: the checked contexts are a few hundred tokens.
    assert shapes.checked_layer() == LayerAttention(window=kernel_choice.CHECK_WINDOW)
    case, expected = case_and_expected(shapes)
    native = kernels.native.kernels()
    assert kernel_choice.check_attention(NativeRowsAttention(native), case, expected) is None
    failure = kernel_choice.check_attention(WindowlessAttention(native), case, expected)
    assert failure is not None and failure.startswith("decode differs from the reference")


GPT_OSS_LAYERS = (LayerAttention(window=128, sinks=True), LayerAttention(sinks=True))


class SinklessAttention(NativeRowsAttention):
    """Claims attention sinks, and leaves them out of its chunks' softmax."""

    name = "sinkless"

    def prefill_sinks(self, q, k, v, kv, chunk, sinks):
        return self.prefill(q, k, v, kv, chunk)


def test_a_model_with_attention_sinks_is_offered_what_serves_them():
    """gpt-oss: the C++ kernels and TritonAttention add the sinks to their softmax;
    FlexAttention does not. The chunk kernel has no windows, so only a model whose layers
    all attend in full (and bfloat16) is offered it."""
    offered = kernels.attention_candidates(CPU, torch.bfloat16, 64, GPT_OSS_LAYERS)
    assert [b.name for b in offered] == ["torch", "native-rows", "hybrid"]
    full = (LayerAttention(sinks=True),)
    offered = kernels.attention_candidates(CPU, torch.bfloat16, 64, full)
    chunk_kernel = NativeAttention.serves(CPU, torch.bfloat16, 64)
    expected = ["torch", "native-rows", "hybrid"] + (["native"] if chunk_kernel else [])
    assert [b.name for b in offered] == expected
    cuda = kernels.attention_candidates(torch.device("cuda"), torch.bfloat16, 64, GPT_OSS_LAYERS)
    assert [b.name for b in cuda] == ["torch", "triton"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_native_kernels_pass_the_check_with_sinks_and_keep_their_rows_invariant(dtype):
    """Checked on gpt-oss's windowed layer (and, in bfloat16, the chunk kernel on its full
    one), with sinks: each agrees with the reference, and a row keeps its bits alone, in
    a batch and as a chunk's row; a candidate that drops the sinks fails."""
    for layers in (GPT_OSS_LAYERS, (LayerAttention(sinks=True),)):
        shapes = Shapes(8, 2, 64, 512, 1024, 16, dtype, CPU, dtype, layers)
        case, expected = case_and_expected(shapes)
        assert case.sinks is not None and case.layer.sinks
        short = kernel_choice.attention_case(shapes, batch=5, chunk=37, start=40)
        native = kernels.native.kernels()
        for backend in kernels.attention_candidates(CPU, dtype, 64, layers)[1:]:
            failure = kernel_choice.check_attention(backend, case, expected, [short])
            assert failure is None, (backend.name, failure)
    failure = kernel_choice.check_attention(SinklessAttention(native), case, expected)
    assert failure is not None and failure.startswith("prefill differs from the reference")


class ShortChunkDependentAttention(NativeRowsAttention):
    """Row invariant on long chunks, but a short chunk's rows are computed otherwise."""

    name = "short-chunks"

    def prefill(self, q, k, v, kv, chunk):
        return super().prefill(q, k, v, kv, chunk) + 1e-3 * (q.shape[0] < 64)


def test_row_invariance_is_held_on_other_shapes_too():
    shapes = smollm_shapes(torch.bfloat16)
    case, expected = case_and_expected(shapes)
    short = kernel_choice.attention_case(shapes, batch=5, chunk=37, start=40)
    backend = ShortChunkDependentAttention(kernels.native.kernels())
    assert kernel_choice.check_attention(backend, case, expected) is None
    assert kernel_choice.check_attention(backend, case, expected, [short]) == (
        "prefill rows differ from the same tokens decoded"
    )


def test_the_chooser_skips_the_fastest_candidate_when_it_fails_its_check(monkeypatch):
    native = kernels.native.kernels()
    offered = [TorchAttention(), NativeRowsAttention(native), ZeroAttention(native)]
    monkeypatch.setattr(kernels, "attention_candidates", lambda *shapes: offered)
    choice = kernel_choice.measure_all(smollm_shapes(torch.bfloat16), {})
    trials = {t.name: t for t in choice.trials["attention"]}
    assert trials["zeros"].ms is None and "differs" in trials["zeros"].failed
    assert choice.kernels.attention.name == "native-rows"
    assert choice.report()["measured"]["attention"]["zeros"].startswith("failed: decode differs")


class RecordingLayerOps(TorchLayerOps):
    """The reference, recording each op it runs: its name, whether a timing was running,
    and the tensor it was given first (x, gate_up or qkv)."""

    name = "recording"

    def __init__(self, calls: list, timing: list[bool]) -> None:
        super().__init__()
        for op in ("rms_norm", "add_rms_norm_", "silu_and_mul", "rope_and_cache_"):
            setattr(self, op, self._recorded(op, getattr(self, op), calls, timing))

    @staticmethod
    def _recorded(op, run, calls, timing):
        def recorded(first, *args):
            calls.append((op, timing[0], first))
            return run(first, *args)

        return recorded


def tiny_shapes(dtype: torch.dtype = torch.float32) -> Shapes:
    return Shapes(4, 2, 16, 64, 96, 4, dtype, CPU, dtype)


def test_layer_ops_are_timed_as_a_layer_runs_them_on_inputs_built_beforehand(monkeypatch):
    timing, calls, built_while_timing = [False], [], []

    def flagging_timer(device):
        wall = kernel_choice.wall_timer(time.perf_counter, lambda: None)

        def timed(call):
            timing[0] = True
            try:
                return wall(call)
            finally:
                timing[0] = False

        return timed

    case = kernel_choice.layer_ops_case

    def recorded_case(shapes, rows):
        built_while_timing.append(timing[0])
        return case(shapes, rows)

    monkeypatch.setattr(kernel_choice, "device_timer", flagging_timer)
    monkeypatch.setattr(kernel_choice, "layer_ops_case", recorded_case)
    candidates = [TorchLayerOps(), RecordingLayerOps(calls, timing)]
    _, trials = kernel_choice.choose_layer_ops(candidates, tiny_shapes())
    assert [t.name for t in trials] == ["torch", "recording"] and not any(t.failed for t in trials)
    assert built_while_timing and not any(built_while_timing)
    timed = [(op, first) for op, during, first in calls if during]
    # Each round: a layer's ops in its order, on each of TIMED_ROWS, on the same tensors.
    layer = ["rope_and_cache_", "add_rms_norm_", "silu_and_mul", "add_rms_norm_"]
    rounds = len(kernel_choice.TIMED_ROWS) * kernel_choice.REPEATS
    assert [op for op, _ in timed] == layer * rounds
    assert {first.shape[0] for _, first in timed} == set(kernel_choice.TIMED_ROWS)
    assert len({first.data_ptr() for _, first in timed}) == 3 * len(kernel_choice.TIMED_ROWS)


class FakeCapturer:
    """Captures by keeping the piece; a replay runs it."""

    def __init__(self) -> None:
        self.captured: list = []

    def new_pool(self) -> object:
        return object()

    def capture(self, piece, pool):
        self.captured.append(piece)
        return SimpleNamespace(replay=piece)


def test_on_cuda_the_layers_of_a_model_are_captured_once_and_replayed_back_to_back():
    timing, calls = [False], []
    capturer = FakeCapturer()
    ops = RecordingLayerOps(calls, timing)
    timed = kernel_choice.timed_layer_ops(ops, tiny_shapes(), capturer)
    assert len(capturer.captured) == 1 and not calls  # captured, not yet run
    timed()
    per_layer = 4 * len(kernel_choice.TIMED_ROWS)
    assert len(calls) == kernel_choice.REPLAYS * kernel_choice.GRAPHED_LAYERS * per_layer
    assert len({first.data_ptr() for _, _, first in calls}) == 3 * len(kernel_choice.TIMED_ROWS)


class OffSiluLayerOps(TorchLayerOps):
    """Its activation 10% off: past the bfloat16 tolerance too."""

    name = "off"

    def __init__(self) -> None:
        super().__init__()
        self.silu_and_mul = lambda gate_up: silu_and_mul(gate_up) * 1.1


class RaisingLayerOps(TorchLayerOps):
    name = "raising"

    def rope_and_cache_(self, *args):
        raise RuntimeError("no kernel image for this device")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_ops_candidate_that_disagrees_or_raises_fails_its_check(dtype):
    candidates = [OffSiluLayerOps(), RaisingLayerOps(), TorchLayerOps()]
    chosen, trials = kernel_choice.choose_layer_ops(candidates, tiny_shapes(dtype))
    assert chosen.name == "torch"
    assert trials[:2] == [
        Trial("off", None, "differs from the reference"),
        Trial("raising", None, "raised no kernel image for this device"),
    ]


def test_pick_times_each_run_by_the_timer_it_is_given():
    """A device timer (CUDA events) reads the device's time, not the clock's."""
    costs, ran = {"slow": 3.0, "fast": 1.0}, []

    def timer(call):
        call()
        return costs[ran[-1]]

    chosen, trials = pick(list(costs), str, lambda c: None, ran.append, timer=timer)
    assert chosen == "fast"
    assert trials == [Trial("slow", 3000.0), Trial("fast", 1000.0)]


def test_pick_waits_for_the_device_around_each_timing():
    """A device that runs work after the launch returns (CUDA): a candidate's time is its
    work's, finished, and not the previous candidate's queue."""
    costs = {"slow": 3.0, "fast": 1.0}
    now, queued = [0.0], [0.0]

    def launch(candidate):  # returns at once; the work waits on the device
        queued[0] += costs[candidate]

    def sync():
        now[0] += queued[0]
        queued[0] = 0.0

    synced = wall_timer(lambda: now[0], sync)
    chosen, trials = pick(list(costs), str, lambda c: None, launch, timer=synced)
    assert chosen == "fast"
    assert trials == [Trial("slow", 3000.0), Trial("fast", 1000.0)]
    unsynced_timer = wall_timer(lambda: now[0], lambda: None)
    unsynced = pick(list(costs), str, lambda c: None, launch, timer=unsynced_timer)
    assert {t.ms for t in unsynced[1]} == {0.0}  # what a timing without the sync reads


def test_pick_takes_the_fastest_passing_candidate_and_preferred_ones_first():
    times = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 0.5}
    failing = {"d"}
    now = [0.0]
    order = []

    def workload(candidate):
        order.append(candidate)
        now[0] += times[candidate]

    def run(preferred):
        order.clear()
        return pick(
            list(times),
            str,
            lambda c: "wrong" if c in failing else None,
            workload,
            preferred,
            timer=wall_timer(lambda: now[0], lambda: None),
        )

    chosen, trials = run(lambda c: True)
    assert chosen == "b"
    assert trials == [
        Trial("a", 3000.0),
        Trial("b", 1000.0),
        Trial("c", 2000.0),
        Trial("d", None, "wrong"),
    ]
    # A warm-up each, then rounds in turn: load that drifts weighs on all alike.
    assert order == ["a", "b", "c"] * (1 + kernel_choice.REPEATS)
    assert run(lambda c: c in ("a", "c"))[0] == "c"  # preferred beats faster
    times["a"] = 30.0
    assert run(lambda c: c == "a")[0] == "a"  # however much slower
    assert run(lambda c: c == "d")[0] == "b"  # a failing preferred one: the fastest passing
    failing.update(times)
    with pytest.raises(NoCorrectKernel, match="a: wrong; b: wrong"):
        run(lambda c: True)


def test_the_choice_is_cached_per_machine_and_shapes(tmp_path, monkeypatch):
    cache = tmp_path / "kernels.json"
    shapes = smollm_shapes(torch.float32)
    first = kernel_choice.choose(shapes, {}, cache)
    assert not first.cached and cache.exists()
    measured = []
    monkeypatch.setattr(kernel_choice, "measure_all", lambda s, p: measured.append(s) or first)
    again = kernel_choice.choose(shapes, {}, cache)
    assert again.cached and again.kernels.names() == first.kernels.names()
    assert again.report()["measured"] == first.report()["measured"]
    assert not measured
    # Other shapes, other pins, a new candidate, another machine: each measures.
    kernel_choice.choose(smollm_shapes(torch.bfloat16), {}, cache)
    kernel_choice.choose(shapes, {"matmul": "aten"}, cache)
    offered = kernels.matmul_candidates
    monkeypatch.setattr(kernels, "matmul_candidates", lambda *args: [*offered(*args), "new"])
    kernel_choice.choose(shapes, {}, cache)
    monkeypatch.setattr(kernels, "matmul_candidates", offered)
    monkeypatch.setattr(kernel_choice, "machine", lambda: {"cpu": "another"})
    kernel_choice.choose(shapes, {}, cache)
    assert len(measured) == 4


def test_a_cached_choice_that_is_no_longer_offered_or_a_broken_cache_is_measured_again(
    tmp_path,
):
    cache = tmp_path / "kernels.json"
    shapes = smollm_shapes(torch.float32)
    kernel_choice.choose(shapes, {}, cache)
    recorded = json.loads(cache.read_text())
    (entry,) = recorded.values()
    entry["names"]["attention"] = "a-kernel-from-another-build"
    cache.write_text(json.dumps(recorded))
    assert not kernel_choice.choose(shapes, {}, cache).cached
    cache.write_text("{not json")
    assert not kernel_choice.choose(shapes, {}, cache).cached
    assert kernel_choice.choose(shapes, {}, cache).cached


def test_pins_parse_and_bind():
    assert parse_kernel_pins("auto") == {}
    assert parse_kernel_pins("attention=torch, matmul=aten") == {
        "attention": "torch",
        "matmul": "aten",
    }
    for bad in ("", "attention", "attention=", "sampler=torch", "attention=torch;matmul=aten"):
        with pytest.raises(ValueError, match="SEAM=NAME"):
            parse_kernel_pins(bad)
    choice = kernel_choice.measure_all(smollm_shapes(torch.bfloat16), {"attention": "torch"})
    assert choice.kernels.attention.name == "torch"
    assert [t.name for t in choice.trials["attention"]] == ["torch"]
    with pytest.raises(NoCorrectKernel, match="pinned attention kernel 'flash3' is not offered"):
        kernel_choice.measure_all(smollm_shapes(torch.bfloat16), {"attention": "flash3"})


def test_the_cli_refuses_bad_pins(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve", "--kernels", "attention=torch"]).kernels == "attention=torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kernels", "attention"])
    assert "SEAM=NAME" in capsys.readouterr().err


def test_the_handshake_reports_the_choice(tiny_llama_dir, tmp_path):
    runner = make_runner(tiny_llama_dir, kernel_cache=str(tmp_path / "k.json"))
    report = runner.handshake.kernels
    # Which candidate wins depends on timing; the report must name what the model runs,
    # with every candidate's time beside it.
    chosen = runner.model.kernels
    assert report["attention"] == chosen.attention.name and report["matmul"] == chosen.matmul
    assert report["layer_ops"] == chosen.layer_ops.name
    assert set(report["measured"]) == {"attention", "layer_ops", "matmul"}
    measured = report["measured"]["attention"]
    assert set(measured) == {"torch", "native-rows", "hybrid"}
    assert all(isinstance(ms, float) and ms > 0 for ms in measured.values())
    assert report["cached"] is False
    assert make_runner(tiny_llama_dir, kernel_cache=str(tmp_path / "k.json")).handshake.kernels[
        "cached"
    ]
    pinned = make_runner(tiny_llama_dir, kernels="attention=torch,layer_ops=torch")
    assert isinstance(pinned.model.kernels.attention, TorchAttention)
    assert pinned.model.ops.name == "torch"


def test_the_cache_is_written_through_a_name_nobody_can_plant(tmp_path):
    """The old temporary name (kernels.<pid>.tmp) was predictable: a symlink planted there
    would have had the worker write over the file it points to."""
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    cache = tmp_path / "kernels.json"
    (tmp_path / f"kernels.{os.getpid()}.tmp").symlink_to(victim)
    choice = kernel_choice.Choice(kernels.reference(), {"matmul": [Trial("aten", 1.0)]})
    kernel_choice._write_cache(cache, "key", choice)
    assert victim.read_text() == "untouched"
    assert json.loads(cache.read_text())["key"]["names"]["matmul"] == "aten"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim", "kernels.json", f"kernels.{os.getpid()}.tmp"]
    )
