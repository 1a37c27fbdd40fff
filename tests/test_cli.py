"""The `cadence` command line: flag errors, log format, and serving from start to shutdown."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
import structlog
import trio

from service.cli import add_serve_args, build_parser, config_from_args
from service.config import Config
from service.flag_types import key_value
from service.logging import configure_logging
from tests.server_fixtures import REPO_ROOT, start_server, stop_server, stream_completion


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--port", "abc"], "invalid int value"),
        (["serve", "--dtype", "float64"], "invalid choice"),
        (["serve", "--kv-memory", "-1"], "must be > 0"),
        (["serve", "--policy-param", "novalue"], "expected KEY=VALUE"),
        (["serve", "--policy", "no_such_policy"], "unknown policy"),
        (["serve", "--policy", "stall_free", "--policy-param", "bogus=1"], "bogus"),
        (["serve", "--otlp-traces-endpoint", "collector:4318"], "expected http(s)://HOST"),
        (["serve", "--otlp-trace-steps", "2"], "must be >= 0 and <= 1"),
        (["serve", "--otlp-trace-steps", "0.5"], "need an endpoint"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_command_lines_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_missing_model_path_is_a_clear_error(tmp_path: Path) -> None:
    result = run_cli("serve", "--model", str(tmp_path / "nothing.gguf"))
    assert result.returncode == 1
    assert "does not exist" in result.stderr


def test_policy_params_parse_as_json_when_they_can() -> None:
    assert key_value("token_budget=256") == ("token_budget", 256)
    assert key_value('weights={"a": 2}') == ("weights", {"a": 2})
    assert key_value("name=plain") == ("name", "plain")
    with pytest.raises(argparse.ArgumentTypeError):
        key_value("=3")


def test_preemption_flags_map_onto_the_config(capsys) -> None:
    parser = build_parser()
    given = ["serve", "--admission-watermark", "0.2", "--max-preemptions", "0"]
    config = config_from_args(parser.parse_args(given))
    assert (config.admission_watermark, config.max_preemptions) == (0.2, 0)
    default = config_from_args(parser.parse_args(["serve"]))
    assert (default.admission_watermark, default.max_preemptions) == (0.05, 3)
    assert Config().admission_watermark > Config().watermark  # hysteresis needs a gap
    for bad, message in [
        (["--admission-watermark", "1"], "must be >= 0 and < 1"),
        (["--admission-watermark", "nan"], "must be >= 0 and < 1"),
        (["--max-preemptions", "-1"], "must be >= 0"),
    ]:
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
        assert message in capsys.readouterr().err


def test_log_lines_are_json_with_ts_level_event_first(tmp_path: Path) -> None:
    log_file = tmp_path / "log.jsonl"
    configure_logging(log_file, "info")
    try:
        structlog.contextvars.bind_contextvars(request_id="r1")
        structlog.get_logger().info("request.received", tenant="t")
        structlog.get_logger().debug("hidden")
        structlog.contextvars.clear_contextvars()
    finally:
        configure_logging(None, "info")
    lines = log_file.read_bytes().splitlines()
    assert len(lines) == 1
    record = orjson.loads(lines[0])
    assert list(record)[:3] == ["ts", "level", "event"]
    assert record["event"] == "request.received" and record["level"] == "info"
    assert record["request_id"] == "r1" and record["tenant"] == "t"
    assert abs(record["ts"] - time.time()) < 60


@pytest.mark.real_model
async def test_serve_from_loading_to_overload_to_graceful_shutdown(tmp_path: Path) -> None:
    # One running slot and one queue place: a third request is refused with 429. SIGTERM
    # lets the two run for --shutdown-timeout (5 s by default) before it ends them.
    server = start_server(
        tmp_path,
        *("--max-num-seqs", "1", "--max-queue", "1", "--shutdown-timeout", "1"),
        admin_token=None,
        wait=False,
    )
    try:
        early = httpx.get(f"{server.url}/health", timeout=10)
        print("health right after the URL was printed:", early.status_code)
        assert early.status_code in (200, 503)  # 200 only if the worker loaded very fast
        if early.status_code == 503:
            refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.headers["retry-after"]
        await trio.to_thread.run_sync(server.wait_healthy)
        disabled = httpx.get(
            f"{server.url}/admin/state", headers={"Authorization": "Bearer anything"}
        )
        assert disabled.status_code == 403
        assert "--admin-token" in disabled.json()["error"]["message"]
        worker_pid = server.worker_pids()[-1]
        first = trio.Event()
        results = []

        async def long_stream(client: httpx.AsyncClient, event: trio.Event | None) -> None:
            body = {"prompt": "Go on forever", "max_tokens": 3000, "ignore_eos": True}
            results.append(await stream_completion(client, body, event))

        async with (
            httpx.AsyncClient(base_url=server.url, timeout=60) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(long_stream, client, first)
            await first.wait()
            nursery.start_soon(long_stream, client, None)  # waits: the only slot is taken
            while len(server.log_events("request.received")) < 2:
                await trio.sleep(0.05)
            overloaded = await client.post("/v1/completions", json={"prompt": "one more"})
            server.process.terminate()  # SIGTERM
        exit_code = await trio.to_thread.run_sync(server.process.wait, 60)
    finally:
        stop_server(server)
    assert overloaded.status_code == 429, overloaded.text
    assert overloaded.headers["retry-after"] and overloaded.json()["error"]["code"] == "overloaded"
    assert exit_code == 0
    assert len(results) == 2
    for result in results:  # both ended with a reason, then [DONE]
        assert result.done and result.error is not None
        assert "shutdown" in result.error["message"]
    finished = server.log_events("request.finished")
    assert [(e["finish_reason"], e["finish_detail"]) for e in finished] == [
        ("abort", "shutdown")
    ] * 2
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)


def test_bench_and_logs_are_dispatched_to_ops() -> None:
    result = run_cli("bench", "--help")
    assert result.returncode == 0 and "usage" in result.stdout.lower()


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser


def test_every_serve_flag_is_documented_in_the_readme() -> None:
    """The flags are built from Config's fields; the README's table must not fall behind."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    undocumented = [
        action.option_strings[0]
        for action in serve_parser()._actions
        if action.option_strings != ["-h", "--help"]
        and not any(f"`{name}" in readme for name in action.option_strings)
    ]
    assert not undocumented


def test_a_flag_not_given_leaves_configs_own_default() -> None:
    assert config_from_args(serve_parser().parse_args([])) == Config()
    given = serve_parser().parse_args(["--no-cuda-graphs", "--no-enable-prefix-caching"])
    config = config_from_args(given)
    assert (config.use_cuda_graphs, config.enable_prefix_caching) == (False, False)
