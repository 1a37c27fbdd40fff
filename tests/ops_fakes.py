"""Test doubles for ops tests: a small real tokenizer and a fake streaming OpenAI server."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import orjson
import trio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ops.corpus import full_text


def train_tokenizer_json(path: Path) -> Path:
    """A byte-level BPE (the SmolLM2 kind) trained on the shipped corpus, saved as JSON."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([full_text()], trainer)
    tokenizer.save(str(path))
    return path


PROMPT_TOKENS = 5  # what the fake's usage says of every prompt


@dataclass(slots=True)
class FakeServer:
    """Streams `max_tokens` chunks `token_gap_s` apart, like /v1/completions with stream=true.

    /v1/chat/completions streams deltas instead: the answer to M messages is ` mMw0 mMw1 ...`.
    A prompt (a chat's last message) containing "FAIL" gets HTTP 500; one containing "CUT"
    has its stream cut after two chunks. Beyond `max_streams` streams at once, a request gets
    HTTP 429. Records the bodies and headers it received, and accepts PUT /admin/policy.
    With `metrics_prefix` ("cadence:", "vllm:") GET /metrics serves prefix-cache counters
    that every streamed request raises by its prompt's PROMPT_TOKENS and `cached_tokens`,
    which its usage reports as prompt_tokens_details when set, and speculative-decoding
    counters raised by `drafted`/`accepted` per streamed request; without, /metrics is a 404.
    """

    token_gap_s: float = 0.005
    max_streams: int | None = None
    open_streams: int = 0
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    policy_puts: list[tuple[dict, str | None]] = field(default_factory=list)  # (body, auth)
    port: int = 0
    cached_tokens: int | None = None
    metrics_prefix: str | None = None
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    drafted: int = 0  # per streamed request, into the speculative-decoding counters
    accepted: int = 0
    streamed: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            method, path, headers, body = await _read_request(stream)
            if (method, path) == ("PUT", "/admin/policy"):
                self.policy_puts.append((orjson.loads(body), headers.get("authorization")))
                await _respond(stream, 200, "application/json", b'{"iteration": 3}')
                return
            if path == "/metrics":
                status, text = (404, "") if self.metrics_prefix is None else (200, self.metrics())
                await _respond(stream, status, "text/plain", text.encode())
                return
            if path == "/v1/models":
                await _respond(
                    stream, 200, "application/json", orjson.dumps({"data": [{"id": "fake-model"}]})
                )
                return
            request = orjson.loads(body)
            self.bodies.append(request)
            self.headers.append(headers)
            prompt = _prompt_of(request)
            if "FAIL" in prompt:
                await _respond(stream, 500, "application/json", b'{"error": "boom"}')
                return
            if self.max_streams is not None and self.open_streams >= self.max_streams:
                await _respond(stream, 429, "application/json", b'{"error": "overloaded"}')
                return
            self.open_streams += 1
            try:
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"connection: close\r\n\r\n"
                )
                await self._stream_tokens(stream, request, prompt)
            finally:
                self.open_streams -= 1

    async def _stream_tokens(self, stream: trio.SocketStream, request: dict, prompt: str) -> None:
        count = request["max_tokens"]
        messages = request.get("messages")
        self.prefix_cache_queries += PROMPT_TOKENS
        self.prefix_cache_hits += self.cached_tokens or 0
        self.streamed += 1
        for i in range(count):
            await trio.sleep(self.token_gap_s)
            if "CUT" in prompt and i == 2:
                return
            finish = "length" if i == count - 1 else None
            if messages is None:
                choice = {"index": 0, "text": f" w{i}", "finish_reason": finish}
            else:
                content = f" m{len(messages)}w{i}"
                choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
            chunk = {"choices": [choice]}
            await stream.send_all(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": count}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        end = {"choices": [], "usage": usage}
        await stream.send_all(b"data: " + orjson.dumps(end) + b"\n\ndata: [DONE]\n\n")

    def metrics(self) -> str:
        """The prefix-cache counters in Prometheus text, among other series."""
        p, labels = self.metrics_prefix, '{model_name="fake-model"}'
        return (
            f"# TYPE {p}prefix_cache_queries_total counter\n"
            f"{p}prefix_cache_queries_total{labels} {self.prefix_cache_queries}\n"
            f"# TYPE {p}prefix_cache_hits_total counter\n"
            f"{p}prefix_cache_hits_total{labels} {self.prefix_cache_hits}\n"
            f"{p}num_requests_running {self.open_streams}\n"
            f"{p}request_received_total {len(self.bodies)}\n"
            f"{p}spec_decode_num_draft_tokens_total{labels} {self.drafted * self.streamed}\n"
            f"{p}spec_decode_num_accepted_tokens_total{labels} {self.accepted * self.streamed}\n"
        )


def _prompt_of(request: dict) -> str:
    return request["messages"][-1]["content"] if "messages" in request else request["prompt"]


async def _read_request(stream: trio.SocketStream) -> tuple[str, str, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        body += await stream.receive_some(65536)
    return method, path, headers, body


async def _respond(stream: trio.SocketStream, status: int, content_type: str, body: bytes) -> None:
    await stream.send_all(
        f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n\r\n".encode()
        + body
    )
