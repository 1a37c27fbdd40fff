"""The memory a cadence server takes under issue 29's attacks (a measurement, not a test):

    .venv/bin/python -m tests.measure_attack_memory [--repeat 3] [--max-stream-buffer-bytes B]

Starts a server as the API tests do (float32, the default model), then sends each attack
of tests/test_api_loop_attacks.py, `--repeat` times one after another, while a thread reads
the resident memory (VmRSS) of the server and of its worker every 20 ms. Two more: the
64 constrained rows of a slow grammar (after one structured request has paid for
xgrammar's vocabulary and compiler, which happens once), and a client that never reads a
stream of 32 sequences (its unread events pass --max-stream-buffer-bytes, 1 MiB here so
that they do soon). Prints, per attack, the statuses (for the last, how its sequences
ended), the peak growth over the memory before it, and what stayed after it.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from tests.server_fixtures import RunningServer, start_server, stop_server
from tests.test_api_loop_attacks import SLOW_GRAMMAR, attacks

SAMPLE_S = 0.02
MIB = 1024 * 1024


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The largest VmRSS of each process while it runs."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = {name: rss(pid) for name, pid in pids.items()}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._done.wait(SAMPLE_S):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss(pid))

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def send(server: RunningServer, method: str, path: str, body: dict) -> int:
    content = orjson.dumps(body)
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=300) as client:
        return client.request(method, path, content=content, headers=headers).status_code


def slow_grammar(server: RunningServer) -> list[object]:
    body = {
        "model": server.model,
        "prompt": "Describe the sea as a JSON string:",
        "response_format": SLOW_GRAMMAR,
        "max_tokens": 2,
        "n": 32,
        "temperature": 0.8,
    }
    statuses: list[object] = []
    threads = [
        threading.Thread(
            target=lambda: statuses.append(send(server, "POST", "/v1/completions", body))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def never_reads(server: RunningServer) -> list[object]:
    """A stream of 32 x 600 tokens, never read: held until the server has ended it (its
    unread bytes pass the bound) or it finished."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    client.connect((host, int(port)))
    body = orjson.dumps(
        {
            "prompt": "Tell a long story",
            "max_tokens": 600,
            "n": 32,
            "ignore_eos": True,
            "stream": True,
        }
    )
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    client.sendall(head.encode() + body)
    try:
        time.sleep(2)
        server.wait_idle(timeout=300)
    finally:
        client.close()
    return [e["finish_detail"] for e in server.log_events("request.finished")[-32:]]


def attack_runs(server: RunningServer, window: int) -> dict[str, Callable[[], list[object]]]:
    runs: dict[str, Callable[[], list[object]]] = {}
    for name, attack in attacks(window).items():

        def run(attack=attack) -> list[object]:
            return [
                send(server, attack.method, attack.path, attack.body) for _ in range(attack.copies)
            ]

        runs[name] = run
    runs["slow_grammar_64_rows"] = lambda: slow_grammar(server)
    runs["never_reads_n32"] = lambda: never_reads(server)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-stream-buffer-bytes", default=str(MIB))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        server = start_server(
            Path(log_dir), "--max-stream-buffer-bytes", args.max_stream_buffer_bytes
        )
        try:
            pids = {"server": server.process.pid, "worker": server.admin_state()["worker_pid"]}
            window = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
            before = {n: rss(p) for n, p in pids.items()}
            body = {"prompt": "{", "max_tokens": 1, "response_format": {"type": "json_object"}}
            send(server, "POST", "/v1/completions", body)
            print(
                "the first structured request (once): "
                + ", ".join(f"{n} +{(rss(p) - before[n]) / MIB:.1f} MiB" for n, p in pids.items())
            )
            start = {name: rss(pid) for name, pid in pids.items()}
            print("at start: " + ", ".join(f"{n} {start[n] / MIB:.0f} MiB" for n in pids))
            for name, run in attack_runs(server, window["max_model_len"]).items():
                before = {n: rss(p) for n, p in pids.items()}
                with Peak(pids) as peak:
                    statuses = [s for _ in range(args.repeat) for s in run()]
                server.wait_idle()
                after = {n: rss(p) for n, p in pids.items()}
                print(
                    f"{name}: {sorted(set(map(str, statuses)))} x{len(statuses)}; "
                    + "; ".join(
                        f"{n} peak +{(peak.peak[n] - before[n]) / MIB:.1f} MiB, "
                        f"after +{(after[n] - before[n]) / MIB:.1f} MiB"
                        for n in pids
                    ),
                    flush=True,
                )
            end = {name: rss(pid) for name, pid in pids.items()}
            print("in all: " + ", ".join(f"{n} +{(end[n] - start[n]) / MIB:.1f} MiB" for n in pids))
        finally:
            stop_server(server)


if __name__ == "__main__":
    main()
