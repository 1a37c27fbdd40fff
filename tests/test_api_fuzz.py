"""Fuzz every route of a live server with schemathesis, from the OpenAPI document it serves.

Schemathesis (`st run`) generates valid and invalid requests from /openapi.json, admin routes
included (it sends the admin token), and checks each answer: never a 5xx, a documented status
and content type, a body that fits the documented schema; a request unanswered within
REQUEST_TIMEOUT_S counts as a hang. The run must send at least MIN_REQUESTS requests, counted
from its HAR report.

The server is its own (the fuzzer swaps policies at random) with a small context window and
API keys on (the admin token is also its one key, since schemathesis sends one bearer), and
this module is also schemathesis' hooks module (SCHEMATHESIS_HOOKS): `before_call` keeps
generations a few tokens long, so the run explores requests rather than waiting on output.
There ast.parse is made one thread at a time: hypothesis parses its lambdas' source while
it generates, on the run's two workers, and CPython's AST constructor keeps its recursion
count where threads share it (see python/cpython#106905), which failed a run on 3.11.7 with
"SystemError: AST constructor recursion depth mismatch".
"""

from __future__ import annotations

import ast
import collections
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis

from service.api.openai_schema import MAX_EMBEDDING_INPUTS
from tests.server_fixtures import ADMIN_TOKEN, REPO_ROOT, RunningServer, start_server, stop_server

pytestmark = pytest.mark.real_model

# The chat template alone is ~30 tokens: 48 leaves chats a few tokens to generate.
MAX_MODEL_LEN = 48
SHORT_GENERATION = 1
SHORT_INPUT_LIST = 4
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")
MIN_REQUESTS = 800
EXAMPLES_PER_OPERATION = 64  # per route and method: far beyond MIN_REQUESTS in all
REQUEST_TIMEOUT_S = 30
RUN_TIMEOUT_S = 600
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)


def parsing_one_thread_at_a_time() -> None:
    parse, lock = ast.parse, threading.Lock()

    @functools.wraps(parse)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return parse(*args, **kwargs)

    ast.parse = locked


if os.environ.get("SCHEMATHESIS_HOOKS") == __name__:
    parsing_one_thread_at_a_time()  # in schemathesis' process (module docstring)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if not isinstance(case.body, dict):
        return
    path = case.operation.path
    if path in GENERATION_PATHS:
        shorten_generation(case.body, LENGTH_FIELDS)
    elif path == "/v1/responses":
        shorten_generation(case.body, ("max_output_tokens",))
    elif path == "/v1/messages":
        shorten_generation(case.body, ("max_tokens",))
    elif path == "/v1/embeddings":
        shorten_embedding(case.body)


def shorten_embedding(body: dict[str, Any]) -> None:
    """Cap a list of inputs the fuzzer made long (up to the 2,048 the route takes: minutes
    of prefill on a CPU) at a few; longer lists stay, they exercise the limit's error."""
    inputs = body.get("input")
    if (
        isinstance(inputs, list)
        and SHORT_INPUT_LIST < len(inputs) <= MAX_EMBEDDING_INPUTS
        and all(isinstance(one, str | list) for one in inputs)
    ):
        body["input"] = inputs[:SHORT_INPUT_LIST]


def shorten_generation(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    """Cap a generation the fuzzer left long (absent, or inside the window) at a few tokens;
    lengths beyond the window stay, they exercise the context-length errors."""
    lengths = [body.get(name) for name in fields]
    if all(value is None for value in lengths):
        body[fields[0]] = SHORT_GENERATION
    for name, value in zip(fields, lengths, strict=True):
        if type(value) is int and SHORT_GENERATION < value <= MAX_MODEL_LEN:
            body[name] = SHORT_GENERATION


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log_dir = tmp_path_factory.mktemp("fuzz-server")
    (log_dir / "api-keys").write_text(f"{ADMIN_TOKEN} fuzz priority\n")
    server = start_server(
        log_dir,
        "--api-key-file",
        str(log_dir / "api-keys"),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-batched-tokens",
        str(MAX_MODEL_LEN),
        wait=False,
    )
    try:
        server.wait_healthy()
    except BaseException:
        stop_server(server)
        raise
    yield server
    stop_server(server)


def run_schemathesis(server: RunningServer, workdir: Path) -> subprocess.CompletedProcess:
    """`st run` in `workdir` (its crash cache goes there, not into the repository), writing
    the HAR report workdir/fuzz.har."""
    command = [
        str(Path(sys.executable).with_name("st")),
        "run",
        f"{server.url}/openapi.json",
        "--header",
        f"Authorization: Bearer {ADMIN_TOKEN}",
        "--checks",
        ",".join(CHECKS),
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        str(EXAMPLES_PER_OPERATION),
        "--workers",
        "2",
        "--seed",
        "1",
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--suppress-health-check",
        "all",
        "--generation-database",
        "none",
        "--no-color",
        "--report",
        "har",
        "--report-har-path",
        str(workdir / "fuzz.har"),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.test_api_fuzz", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        command,
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def test_fuzzing_every_route_finds_no_server_error_and_no_hang(
    fuzz_server: RunningServer, tmp_path: Path
) -> None:
    assert httpx.get(f"{fuzz_server.url}/v1/models", timeout=10).status_code == 401  # keys on
    start = time.monotonic()
    result = run_schemathesis(fuzz_server, tmp_path)
    seconds = time.monotonic() - start
    entries = json.loads((tmp_path / "fuzz.har").read_text())["log"]["entries"]
    statuses = collections.Counter(entry["response"]["status"] for entry in entries)
    print(result.stdout[-6000:])
    print(f"{len(entries)} requests in {seconds:.0f} s; statuses {sorted(statuses.items())}")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert len(entries) >= MIN_REQUESTS
    assert not [status for status in statuses if status >= 500 or status == 0]
    assert fuzz_server.process.poll() is None
    assert fuzz_server.wait_idle()["kv_blocks_used"] == 0
