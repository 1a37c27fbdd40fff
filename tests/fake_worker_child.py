"""A stand-in worker process for WorkerLink tests: speaks the protocol, no model.

Run as `python tests/fake_worker_child.py --fd N`. FAKE_WORKER_MODE picks a behaviour:
"ok" (answer steps: token = 1000 + step_id), "fatal" (fail init), "exit_at_init" (exit
without a word), "die_on_step_2" (exit abruptly on the second step), "device_error_on_step_2"
(report a fatal device error at the second step, then exit), "ignore_shutdown"
(never exits on its own; the link must kill it), "slow_pong" (answers pings after 0.5 s);
"garbled_on_step_2", "list_on_step_2", "unknown_field_on_step_2", "short_tokens_on_step_2"
(a frame that is not JSON, a JSON list, a result with a field the contract lacks, a
result with fewer tokens than sequences, at the second step).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_worker.protocol import DEVICE_ERROR, HEADER, FrameDecoder, encode_frame


def handshake() -> dict:
    return {
        "type": "ready",
        "model_name": "fake",
        "architecture": "Fake",
        "vocab_size": 2000,
        "max_model_len": 4096,
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 1,
        "dtype": "float32",
        "device": "cpu",
        "block_size": 16,
        "num_blocks": 64,
        "kv_bytes": 0,
        "kv_cache_dtype": "float32",
        "decode_buckets": [1],
        "pid": os.getpid(),
        "load_seconds": 0.0,
    }


GARBLES = {
    "garbled_on_step_2": lambda result: HEADER.pack(5) + b"{nope",
    "list_on_step_2": lambda result: encode_frame([1, 2, 3]),  # type: ignore[arg-type]
    "unknown_field_on_step_2": lambda result: encode_frame({**result, "surprise": 1}),
    "short_tokens_on_step_2": lambda result: encode_frame({**result, "tokens": []}),
}


# Long on purpose (PLR0915): one branch per message and fake mode, read as a table
def main() -> int:  # noqa: PLR0915
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    fd = parser.parse_args().fd
    mode = os.environ.get("FAKE_WORKER_MODE", "ok")
    sock = socket.socket(fileno=fd)
    decoder = FrameDecoder()
    steps = warm_ups = 0
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return 0
        for msg in decoder.feed(data):
            kind = msg["type"]
            if kind == "init":
                if mode == "exit_at_init":
                    os._exit(3)
                if mode == "fatal":
                    sock.sendall(encode_frame({"type": "fatal", "message": "no such model"}))
                    return 1
                sock.sendall(encode_frame(handshake()))
            elif kind == "step":
                warm_ups += msg["step_id"] < 0  # the link's warm-up steps have negative ids
                steps += msg["step_id"] >= 0
                if mode == "die_on_step_2" and steps == 2:
                    os._exit(9)
                if mode == "device_error_on_step_2" and steps == 2:
                    fatal = {"type": "fatal", "reason": DEVICE_ERROR, "message": "CUDA error"}
                    sock.sendall(encode_frame(fatal))
                    return 3
                sampled = [row["seq_id"] for row in msg["rows"] if row["sample"]]
                result = {
                    "type": "result",
                    "step_id": msg["step_id"],
                    "seq_ids": sampled,
                    "tokens": [[1000 + msg["step_id"]]] * len(sampled),
                    "logprobs": None,
                    "step_ms": 1.0,
                    "error": None,
                }
                if steps == 2 and mode in GARBLES:
                    sock.sendall(GARBLES[mode](result))
                    continue
                sock.sendall(encode_frame(result))
            elif kind == "ping":
                if mode == "slow_pong":
                    time.sleep(0.5)
                sock.sendall(encode_frame({"type": "pong"}))
            elif kind == "env":  # test-only: what the worker's environment holds
                sock.sendall(encode_frame({"type": "env", "env": dict(os.environ)}))
            elif kind == "warm_ups":  # test-only: warm-up steps seen before the first real one
                sock.sendall(encode_frame({"type": "warm_ups", "count": warm_ups}))
            elif kind == "shutdown":
                if mode == "ignore_shutdown":
                    time.sleep(3600)
                return 0


if __name__ == "__main__":
    sys.exit(main())
