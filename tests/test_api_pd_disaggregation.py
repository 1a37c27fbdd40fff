"""Disaggregated prefill and decode through `cadence pd` (a producer, a consumer and
vllm-router in P/D mode, started and stopped as one) with the official openai client: the
producer (--kv-transfer-role producer) computes each prompt and holds its K/V, the consumer
(--kv-transfer-role consumer) pulls it with Mooncake's real transfer engine over loopback
TCP and decodes. The pair's greedy output in float32 equals one server's; the producer
generated one token per request and the consumer computed one prompt token per request;
every hold is released by the consumer's notice; both sides end with every block free
(--debug-invariants checks the accounting at every step meanwhile). SIGTERM to the command
stops all three and their workers, and it exits 0."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_fixtures import (
    ADMIN_TOKEN,
    REPO_ROOT,
    SMALL_KV_BYTES,
    STARTUP_SECONDS,
    RunningServer,
    alive,
    cache_dir,
    seconds_until,
)

pytestmark = pytest.mark.real_model

GENERATED = 8
PROMPTS = ["The capital of France is a city that", "List three prime numbers:"]
QUESTIONS = ["Name three colours.", "Say hello in French."]


@dataclass(slots=True)
class Pair:
    producer: RunningServer
    consumer: RunningServer
    router: str
    pids: list[int]  # the three processes `cadence pd` started, then the servers' workers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pd_command(log_dir: Path) -> list[str]:
    token_file = log_dir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    return [
        sys.executable, "-m", "service.cli", "pd", "--port", "0", "--log-dir", str(log_dir),
        "--", "--dtype", "float32", "--device", "cpu", "--kv-memory", str(SMALL_KV_BYTES),
        "--cache-dir", str(cache_dir()), "--admin-token-file", str(token_file),
        "--debug-invariants",
    ]  # fmt: skip


def read_ready(process: subprocess.Popen, timeout: float) -> dict[str, tuple[str, int]]:
    """What `cadence pd` printed once ready: each process's URL and pid, by name."""
    assert process.stdout is not None
    started: dict[str, tuple[str, int]] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (line := process.stdout.readline().decode()):
        if found := re.match(r"(producer|consumer|router): (\S+) \(pid (\d+)\)", line):
            started[found[1]] = (found[2], int(found[3]))
        if "ready" in line:
            return started
    raise RuntimeError(f"cadence pd not ready: exit {process.poll()}, printed {started}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    log_dir = tmp_path_factory.mktemp("pd")
    stderr = open(log_dir / "pd.stderr", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        pd_command(log_dir), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr
    )
    try:
        started = read_ready(process, STARTUP_SECONDS)
        servers = [
            RunningServer(started[role][0], process, log_dir / f"{role}.log", "")
            for role in ("producer", "consumer")
        ]
        workers = [pid for server in servers for pid in server.worker_pids()]
        pids = [pid for _, pid in started.values()] + workers
        yield Pair(*servers, started["router"][0], pids)
    finally:
        process.send_signal(signal.SIGTERM)  # what Ctrl-C does
        returncode = process.wait(60)
        stderr.close()
    assert returncode == 0, (log_dir / "pd.stderr").read_text()[-3000:]
    seconds_until(lambda: not any(map(alive, pids)), 10)  # none outlived it


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def completion(url: str, model: str, prompt: str, stream: bool) -> tuple[str, object]:
    kwargs: dict = dict(model=model, max_tokens=GENERATED, temperature=0)
    if not stream:
        reply = client(url).completions.create(prompt=prompt, **kwargs)
        return reply.choices[0].text, reply.usage
    chunks = list(
        client(url).completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage


def chat(url: str, model: str, question: str, stream: bool) -> tuple[str, object]:
    messages = [{"role": "user", "content": question}]
    kwargs: dict = dict(model=model, messages=messages, max_tokens=GENERATED, temperature=0)
    if not stream:
        reply = client(url).chat.completions.create(**kwargs)
        return reply.choices[0].message.content or "", reply.usage
    chunks = list(
        client(url).chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def counters(server: RunningServer) -> tuple[list[int], int]:
    """Its finished requests' completion tokens, and the tokens its steps computed."""
    finished = [e["completion_tokens"] for e in server.log_events("request.finished")]
    computed = sum(e["batch_tokens"] for e in server.log_events("iteration"))
    return finished, computed


def test_the_pair_behind_vllm_router_answers_as_one_server(
    pair: Pair, cadence_server: RunningServer
) -> None:
    model = cadence_server.model
    asks = [(completion, p) for p in PROMPTS] + [(chat, q) for q in QUESTIONS]
    for i, (ask, text) in enumerate(asks):
        stream = i % 2 == 1
        alone, _ = ask(cadence_server.url, model, text, False)
        handed, usage = ask(pair.router, model, text, stream)
        assert handed == alone, (text, stream)
        assert usage is not None and usage.completion_tokens == GENERATED
    produced, _ = counters(pair.producer)
    assert produced == [1] * len(asks)  # each prompt's one token, then its K/V held
    decoded, computed = counters(pair.consumer)
    assert decoded == [GENERATED] * len(asks)
    # the prompt's last token and the generated ones but the last: one prompt token each
    assert computed == len(asks) * GENERATED
    for server in (pair.producer, pair.consumer):
        state = server.wait_idle()
        assert state["kv_blocks_used"] == 0
    holds = pair.producer.admin_state()["kv_transfer"]["holds"]
    assert holds == {"holding": 0, "held": len(asks), "released": len(asks), "expired": 0}
    metrics = httpx.get(f"{pair.producer.url}/metrics", timeout=10).text
    assert f'cadence:kv_transfer_holds_total{{outcome="released"}} {len(asks)}.0' in metrics
    assert 'cadence:kv_transfer_holds_total{outcome="expired"} 0.0' in metrics


def test_a_consumer_refuses_another_layout_and_fails_a_pull_it_cannot_make(pair: Pair) -> None:
    """A streamed do_remote_decode and another layout get a 400 naming the field; a
    producer that is gone: 503 kv_transfer_failed, the blocks free again."""
    body = {"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
    ask = {**body, "kv_transfer_params": {"do_remote_decode": True}}
    streamed = httpx.post(
        f"{pair.producer.url}/v1/completions", json={**ask, "stream": True}, timeout=60
    )
    assert streamed.status_code == 400  # its answer could not say where the K/V waits
    held = httpx.post(f"{pair.producer.url}/v1/completions", json=ask, timeout=60).json()
    params = held["kv_transfer_params"]
    other = {**params, "fingerprint": {**params["fingerprint"], "dtype": "bfloat16"}}
    refused = httpx.post(
        f"{pair.consumer.url}/v1/completions",
        json={**body, "kv_transfer_params": other},
        timeout=60,
    )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "kv_transfer_params" and "dtype" in error["message"]
    gone = {**params, "remote_port": free_port()}  # nothing listens there
    failed = httpx.post(
        f"{pair.consumer.url}/v1/completions", json={**body, "kv_transfer_params": gone}, timeout=60
    )
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "kv_transfer_failed"
    assert pair.consumer.wait_idle()["kv_blocks_used"] == 0
    # the hold nobody pulled is still the producer's; the right pull releases it
    pulled = httpx.post(
        f"{pair.consumer.url}/v1/completions",
        json={**body, "kv_transfer_params": params},
        timeout=60,
    )
    assert pulled.status_code == 200
    assert pair.producer.wait_idle()["kv_transfer"]["holds"]["holding"] == 0
