import orjson

from ops.log_parse import NOT_EVENT, NOT_JSON, parse_log
from ops.logs_report import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def iteration_line(ts, i, policy, prefill, decode):
    return {
        "ts": ts,
        "level": "info",
        "event": "iteration",
        "iteration": i,
        "policy": policy,
        "prefill_tokens": prefill,
        "decode_seqs": decode,
        "batch_tokens": prefill + decode,
        "num_seqs": decode + (prefill > 0),
        "running": decode,
        "waiting": 0,
        "kv_blocks_used": 10 + i,
        "kv_blocks_total": 100,
        "step_ms": 5.0 + prefill / 10,
        "schedule_ms": 0.3,
        "preempted": 0,
    }


def finished_line(ts, rid, tenant, policy, ttft, itl_max):
    return {
        "ts": ts,
        "level": "info",
        "event": "request.finished",
        "request_id": rid,
        "tenant": tenant,
        "policy": policy,
        "finish_reason": "length",
        "finish_detail": "max_tokens",
        "prompt_tokens": 100,
        "completion_tokens": 20,
        "ttft_ms": ttft,
        "itl_p50_ms": 6.0,
        "itl_p99_ms": None if itl_max is None else itl_max * 0.9,
        "itl_max_ms": itl_max,
        "queue_ms": 1.0,
        "e2e_ms": 300.0,
        "preemptions": 0,
    }


def write_log(path):
    lines = [
        {
            "ts": 100.0,
            "level": "info",
            "event": "worker.started",
            "pid": 1,
            "num_blocks": 100,
            "load_seconds": 2.0,
        }
    ]
    lines += [iteration_line(100.0 + i / 10, i, "fcfs", 300 if i == 3 else 0, 4) for i in range(10)]
    lines.append(
        {
            "ts": 101.05,
            "level": "info",
            "event": "policy.swap",
            "old": "fcfs",
            "new": "stall_free",
            "params": {},
            "iteration": 11,
            "by": "api",
        }
    )
    lines += [iteration_line(101.1 + i / 10, 11 + i, "stall_free", 64, 4) for i in range(10)]
    lines += [
        finished_line(101.0, "a", "alice", "fcfs", 50.0, 40.0),
        finished_line(101.2, "b", "bob", "fcfs", 70.0, 35.0),
        finished_line(102.0, "c", "alice", "stall_free", 90.0, 12.0),
        finished_line(102.1, "d", "bob", "stall_free", None, None),
    ]
    old_format = {"ts": 102.2, "event": "iteration", "iteration": 99, "policy": "fcfs"}
    bad_type = finished_line(102.3, "e", "bob", "fcfs", "fast", 1.0)
    text = b"\n".join(orjson.dumps(x) for x in [*lines, old_format, bad_type])
    text += b'\n[1, 2]\n{"ts": 1, "message": "plain"}\n\n' + orjson.dumps(lines[1])[:37]
    path.write_bytes(text)
    return path


def test_parse_counts_good_skipped_and_other_lines(tmp_path):
    log = parse_log(write_log(tmp_path / "cadence.log"))
    assert len(log.iterations) == 20 and len(log.requests) == 4 and len(log.swaps) == 1
    assert log.swaps[0].new == "stall_free" and log.swaps[0].iteration == 11
    assert log.skipped[NOT_JSON] == 1  # the cut-off last line
    assert log.skipped[NOT_EVENT] == 2
    assert log.skipped["iteration: missing or mistyped fields (other format)"] == 1
    assert log.skipped["request.finished: missing or mistyped fields (other format)"] == 1
    assert log.other_events == {"worker.started": 1}
    assert log.lines == 31  # blank lines are not counted
    assert log.requests[3].ttft_ms is None
    assert log.start_ts == 100.0


def test_report_writes_markdown_and_pngs(tmp_path, capsys):
    source = write_log(tmp_path / "cadence.log")
    out = tmp_path / "report"
    assert main([str(source), "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    for image in (
        "iteration_tokens.png",
        "step_and_kv.png",
        "requests_by_policy.png",
        "requests_by_tenant.png",
    ):
        data = (out / image).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
        assert f"]({image})" in report
    assert "| not JSON (cut off or corrupt) | 1 |" in report
    assert "| worker.started | 1 |" in report
    assert "| fcfs | stall_free | api |" in report
    # by policy: fcfs TTFT p50 of 50 and 70 is 60; stall_free has one TTFT (90)
    assert "| fcfs | 2 | 60.0 |" in report
    assert "| stall_free | 2 | 90.0 |" in report
    assert "| alice | 2 |" in report and "| bob | 2 |" in report
    assert "wrote" in capsys.readouterr().out


def test_report_copes_with_empty_and_garbage_logs(tmp_path):
    garbage = tmp_path / "garbage.log"
    garbage.write_bytes(b'\xff\xfe not json\n{"event": 3}\n')
    assert main([str(garbage)]) == 0
    report = (tmp_path / "garbage.log-report" / "report.md").read_text()
    assert "No iteration lines." in report and "No request.finished lines." in report
    assert main([str(tmp_path / "missing.log")]) == 2
