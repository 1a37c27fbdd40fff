"""The device check's service: the real service (`cadence serve`) started on loopback with
the check's timing model (the 1B Llama widths on a GPU, the tiny one with --quick) and a
word-level tokenizer written beside it, kept for the sections after the one that started
it in its process (`serve_http`, then ops.device_promise's `interference` and `capacity`),
and stopped gracefully by the last of them; and the `serve_http` section: one chat
completion over HTTP.

A GPU host has torch, transformers and numpy, but maybe not the service's dependencies.
Given `--wheels DIR`, the first section that needs them installs them from that folder
(pip, no index) before it starts the service; without it, a host that lacks them has the
sections skipped, saying which are missing. What the folder must hold is pyproject.toml's
dependencies less torch and numpy, the host's own, with theirs (ops.device_wheels;
`python -m ops.device_check --requirements` prints them). It reads HTTP with urllib: httpx
is one of the dependencies that may be missing.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ops.device_report import ROOT, say
from ops.device_sections import Context
from ops.device_wheels import distribution, install_command, service_requirements

START_TIMEOUT_S = 90  # until /health answers 200: the 1B model loads, chooses and captures
REQUEST_TIMEOUT_S = 20
STOP_TIMEOUT_S = 10
MAX_NUM_SEQS = 32  # the interference scenario's streams and prompts, in one decode batch


def missing_modules(env: dict[str, str] | None = None) -> list[str]:
    """The service's dependencies that do not import, in a fresh interpreter with `env`."""
    modules = [distribution(r).replace("-", "_") for r in service_requirements()]
    probe = (
        "import importlib, sys\n"
        "missing = []\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        missing.append(name)\n"
        "print(' '.join(missing))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise RuntimeError(f"the import probe failed: {done.stderr[-2000:]}")
    return done.stdout.split()


def install(wheels: Path) -> float:
    """Installs the service's dependencies from `wheels` into this Python; its seconds."""
    started = time.perf_counter()
    done = subprocess.run(install_command(wheels), capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "externally-managed-environment" in done.stdout + done.stderr:
        done = subprocess.run(
            install_command(wheels, True), capture_output=True, text=True, timeout=120
        )
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install from {wheels}:\n{done.stderr[-3000:]}")
    return round(time.perf_counter() - started, 1)


def prepare(ctx: Context) -> dict[str, Any]:
    """Makes the service's dependencies importable, installing them from --wheels when
    some are missing: what that took (install_s), or, with no wheels given, the skipped
    result a section returns as it is (its "skipped" says which are missing)."""
    if ctx.server is not None:
        return {}
    missing = missing_modules()
    if not missing:
        return {}
    if ctx.wheels is None:
        return {
            "skipped": "service dependencies missing: " + ", ".join(missing),
            "hint": "give --wheels DIR (README: Device check)",
            "ok": True,
        }
    say(f"installing {', '.join(missing)} from {ctx.wheels}")
    found = {"install_s": install(ctx.wheels)}
    if still := missing_modules():
        raise RuntimeError(f"still missing after the install: {', '.join(still)}")
    return found


def service(ctx: Context) -> tuple[Server, dict[str, Any]]:
    """The service this process keeps, started now if no section before started it, and
    the seconds its start took (none when it was kept)."""
    if ctx.server is not None:
        return ctx.server, {}
    model = ctx.model_dir("llama", timing=True)
    server = Server(ctx, with_tokenizer(model, ctx.profile.timing_model["vocab_size"]))
    try:
        started = server.start()
    except BaseException:
        server.stop()
        raise
    ctx.server = server
    return server, started


def finish(ctx: Context, found: dict[str, Any]) -> dict[str, Any]:
    """Stops the service gracefully when this section is the last of its process, and
    records the exit code in `found`; a later section of the process keeps it."""
    if ctx.server is not None and ctx.last_in_process:
        found["exit_code"] = ctx.server.stop()
        ctx.server = None
    return found


def on_service(ctx: Context, measure: Callable[[Server], dict[str, Any]]) -> dict[str, Any]:
    """A section on the service: its dependencies made ready (or the section skipped
    without them), the service kept or started, `measure` run against it (its result,
    "ok" included), and the service stopped if this section is its process's last."""
    found = prepare(ctx)
    if "skipped" in found:
        return found
    server, started = service(ctx)
    try:
        found |= started | measure(server)
    finally:
        finish(ctx, found)
    return found


def serve_http(ctx: Context) -> dict[str, Any]:
    return on_service(ctx, _chat)


def _chat(server: Server) -> dict[str, Any]:
    found = server.chat()
    return found | {"ok": found["status"] == 200 and found["completion_tokens"] > 0}


def with_tokenizer(model_dir: Path, vocab: int) -> Path:
    """Writes a word-level tokenizer of `vocab` tokens (ids 0-2: <unk>, <s>, </s>, as the
    model's config says) and a chat template beside the model: the service needs both."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(3, vocab))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


class Server:
    """`python -m service.cli serve` on loopback, in the section's process group: the
    section's timeout stops it too, and its worker dies with it. Prefix caching is off, so
    that a workload run twice (once per policy) computes its prompts twice."""

    def __init__(self, ctx: Context, model: Path) -> None:
        self.ctx = ctx
        self.model = model
        self.url = ""
        self.name = ""
        self.admin_token = secrets.token_hex(16)
        self.log = ctx.out / "logs" / "service.server.log"
        self.iterations = ctx.out / "logs" / "service.jsonl"  # one JSON line per iteration
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        ctx = self.ctx
        return [
            sys.executable, "-m", "service.cli", "serve",
            "--model", str(self.model),
            "--device", ctx.device,
            "--dtype", ctx.serving_dtype,
            "--host", "127.0.0.1",
            "--port", "0",
            "--kv-memory", "0.1",
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--no-enable-prefix-caching",
            "--kernels", ctx.kernels,
            "--cache-dir", str(ctx.work),  # the kernel choices the sections measured
            "--step-timeout", "120",  # a first step may compile
            "--log-file", str(self.iterations),
        ]  # fmt: skip

    def start(self) -> dict[str, Any]:
        started = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CADENCE_ADMIN_TOKEN": self.admin_token}
        self.process = subprocess.Popen(
            self.command(), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self.log.open("wb")
        )
        self.url = self._listening_url(started + START_TIMEOUT_S)
        listening = time.monotonic() - started
        self._wait_healthy(started + START_TIMEOUT_S)
        self.name = self._get("/v1/models")["data"][0]["id"]
        say(f"serving {self.name} at {self.url}")
        return {
            "listening_s": round(listening, 1),
            "healthy_s": round(time.monotonic() - started, 1),
        }

    def chat(self) -> dict[str, Any]:
        body = {
            "model": self.name,
            "messages": [{"role": "user", "content": "w5 w6 w7"}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        started = time.monotonic()
        request = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            status, answer = response.status, json.loads(response.read())
        found = {
            "status": status,
            "request_ms": round((time.monotonic() - started) * 1000, 1),
            "completion_tokens": answer["usage"]["completion_tokens"],
            "content": answer["choices"][0]["message"]["content"][:80],
        }
        say(f"chat completion: {found}")
        return found

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it hangs; its exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def _listening_url(self, deadline: float) -> str:
        """The URL the server prints once it listens (its port is chosen by the system)."""
        process = self.process
        assert process is not None and process.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True)
        reader.start()
        while time.monotonic() < deadline and process.poll() is None:
            for line in lines:
                if line.startswith("cadence listening on "):
                    return line.removeprefix("cadence listening on ").strip()
            time.sleep(0.1)
        raise RuntimeError(f"the server did not listen (exit {process.poll()}): {self._tail()}")

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            assert self.process is not None
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"the server did not become healthy: {self._tail()}")

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=REQUEST_TIMEOUT_S) as response:
            return json.loads(response.read())

    def _tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def _read_lines(stream: Any, lines: list[str]) -> None:
    for line in iter(stream.readline, b""):
        lines.append(line.decode(errors="replace"))
