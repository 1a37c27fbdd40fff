import itertools

import trio

from ops.client import ClientConfig, RequestSpec, api_root, run_workload
from tests.ops_fakes import FakeServer


def spec(index: int, prompt: str, max_tokens: int, arrival_s: float = 0.0, **extra) -> RequestSpec:
    return RequestSpec(index, arrival_s, prompt, 3, max_tokens, **extra)


def test_api_root_accepts_v1_and_trailing_slash():
    assert api_root("http://h:1/v1/") == "http://h:1"
    assert api_root("http://h:1/") == "http://h:1"


async def test_records_every_chunk_usage_and_failures_without_stopping(nursery):
    server = FakeServer()
    await nursery.start(server.serve)
    specs = [
        spec(0, "hello", 6, tenant="acme"),
        spec(1, "please FAIL", 4),
        spec(2, "CUT short", 6),
        spec(3, "later", 3, arrival_s=0.15),
    ]
    result = await run_workload(ClientConfig(server.url, "fake-model"), specs)
    ok, failed, cut, late = result.records

    assert ok.ok and ok.error is None
    assert len(ok.chunk_times) == 6 and ok.completion_tokens == 6 and ok.prompt_tokens == 5
    assert ok.finish_reason == "length"
    assert ok.send_s <= ok.first_token_s == ok.chunk_times[0] <= ok.chunk_times[-1] <= ok.end_s
    assert all(b >= a for a, b in itertools.pairwise(ok.chunk_times))

    assert not failed.ok and failed.status == 500 and "HTTP 500" in failed.error
    # a stream cut before [DONE] keeps what arrived; no usage, so tokens = chunks
    assert len(cut.chunk_times) == 2 and cut.output_tokens == 2 and cut.finish_reason is None
    assert late.ok and late.send_s >= 0.15

    body = next(b for b in server.bodies if b["prompt"] == "hello")
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 6
    assert body["stream_options"] == {"include_usage": True} and body["user"] == "acme"
    tenants = [h.get("x-tenant") for h in server.headers]
    assert "acme" in tenants


async def test_concurrency_limit_serialises_requests(nursery):
    server = FakeServer()
    await nursery.start(server.serve)
    specs = [spec(i, f"p{i}", 3) for i in range(3)]
    result = await run_workload(ClientConfig(server.url, "m", concurrency=1), specs)
    spans = sorted((r.send_s, r.end_s) for r in result.records)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end


async def test_unreachable_server_and_timeout_are_recorded(nursery):
    server = FakeServer(token_gap_s=0.5)
    await nursery.start(server.serve)
    slow = await run_workload(ClientConfig(server.url, "m", timeout_s=0.2), [spec(0, "x", 5)])
    assert slow.records[0].error.startswith("timeout")
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    for listener in listeners:
        await listener.aclose()
    dead = await run_workload(ClientConfig(f"http://127.0.0.1:{port}", "m"), [spec(0, "x", 2)])
    assert dead.records[0].error and "Connect" in dead.records[0].error
