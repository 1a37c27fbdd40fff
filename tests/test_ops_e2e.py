"""`cadence bench interference` against a real cadence server, then `cadence logs report` on
that server's own log with a cut-off line appended."""

import orjson
import pytest

from ops.commands import bench as bench_main
from ops.log_parse import NOT_JSON, parse_log
from ops.logs_report import main as report_main
from tests.server_fixtures import cache_dir, start_server, stop_server

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DECODERS, DECODER_TOKENS, DECODER_PROMPT, INJECTED_TOKENS = 2, 24, 32, 3
INJECT = "32@0.2,160@0.5"


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


@pytest.mark.real_model
def test_interference_bench_and_log_report_on_a_real_server(tmp_path, capsys):
    server = start_server(tmp_path)
    try:
        out = tmp_path / "bench"
        argv = [
            "interference", "--url", server.url,
            "--tokenizer", str(cache_dir() / "models" / "SmolLM2-135M-Instruct"),
            "--out", str(out), "--decoders", str(DECODERS),
            "--decoder-tokens", str(DECODER_TOKENS), "--decoder-prompt-len", str(DECODER_PROMPT),
            "--inject", INJECT, "--injected-tokens", str(INJECTED_TOKENS),
            "--slo-ttft-ms", "60000", "--timeout", "120",
        ]  # fmt: skip
        assert bench_main(argv) == 0
        printed = capsys.readouterr().out
    finally:
        stop_server(server)
    print(printed)  # the numbers, for whoever reads the test output

    doc = orjson.loads((out / "bench.json").read_bytes())
    summary, requests = doc["summary"], doc["requests"]
    assert summary["failed"] == 0 and summary["succeeded"] == DECODERS + 2
    for r in requests:
        # the server counts exactly the tokens the prompt maker aimed for, and honours ignore_eos
        assert r["prompt_tokens"] == r["prompt_len"], r
        assert r["completion_tokens"] == r["max_tokens"], r
        assert r["finish_reason"] == "length"
        assert r["send_s"] <= r["first_token_s"] <= r["end_s"]
    decoders = [r for r in requests if r["role"] == "decoder"]
    assert all(len(r["chunk_times"]) >= 0.8 * DECODER_TOKENS for r in decoders)
    assert summary["output_tokens"] == DECODERS * DECODER_TOKENS + 2 * INJECTED_TOKENS
    assert summary["itl_ms"]["p50"] > 0 and summary["ttft_ms"]["max"] > 0
    windows = doc["interference"]
    assert [w["prompt_len"] for w in windows] == [32, 160]
    assert all(w["injected_ttft_ms"] > 0 for w in windows)
    assert any(w["decoders_active"] > 0 for w in windows)
    assert "decoder ITL max ms" in printed and "TTFT ms" in printed
    for image in ("token_gaps.png", "itl_cdf.png", "ttft_by_prompt_len.png"):
        assert_png(out / image)

    log_file = server.log_file
    with log_file.open("ab") as f:
        f.write(b'{"ts": 1.0, "level": "info", "event": "iterat')  # cut off mid-line
    report_dir = tmp_path / "report"
    assert report_main(["report", str(log_file), "--out", str(report_dir)]) == 0
    log = parse_log(log_file)
    assert log.skipped[NOT_JSON] == 1
    # every decoder token takes one iteration; injected prompts may share those iterations
    assert len(log.requests) == DECODERS + 2 and len(log.iterations) >= DECODER_TOKENS
    assert sum(i.prefill_tokens for i in log.iterations) >= DECODERS * DECODER_PROMPT + 32 + 160
    report = (report_dir / "report.md").read_text()
    assert f"| finished requests | {DECODERS + 2} |" in report
    assert "| not JSON (cut off or corrupt) | 1 |" in report
    for image in (
        "iteration_tokens.png",
        "step_and_kv.png",
        "requests_by_policy.png",
        "requests_by_tenant.png",
    ):
        assert_png(report_dir / image)
