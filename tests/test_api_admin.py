"""Admin API on a real server: bearer auth matrix, validation, and a live policy swap."""

from __future__ import annotations

import httpx
import pytest
import trio

from gpu_worker import native
from tests import server_fixtures
from tests.server_fixtures import RunningServer, stream_completion

pytestmark = pytest.mark.real_model
ENDPOINTS = [
    ("GET", "/admin/policy", None),
    ("GET", "/admin/state", None),
    ("PUT", "/admin/policy", {"name": "stall_free"}),
]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (None, 401),
        ("Bearer wrong-token", 403),
        (f"Bearer {server_fixtures.ADMIN_TOKEN[:-3]}", 403),  # a prefix of the token
        (f"Bearer {server_fixtures.ADMIN_TOKEN}-and-more", 403),  # the token extended
        (f"Bearer {server_fixtures.ADMIN_TOKEN.upper()}", 403),
        ("Basic dGVzdA==", 401),
        (f"Bearer {server_fixtures.ADMIN_TOKEN}", 200),
    ],
)
def test_auth_matrix(
    cadence_server: RunningServer,
    method: str,
    path: str,
    body: dict | None,
    authorization: str | None,
    status: int,
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(
        method, f"{cadence_server.url}{path}", json=body, headers=headers, timeout=30
    )
    assert response.status_code == status, response.text
    if status != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "body",
    [
        {"name": "no_such_policy"},
        {"name": "stall_free", "params": {"token_budget": -5}},
        {"name": "stall_free", "params": {"bogus": 1}},
        {"name": "stall_free", "params": "x"},
        {"name": 3},
        {"nam": "fcfs"},
    ],
)
def test_bad_policy_change_is_400_and_changes_nothing(
    cadence_server: RunningServer, body: dict
) -> None:
    admin = cadence_server.admin_headers()
    before = httpx.get(f"{cadence_server.url}/admin/policy", headers=admin).json()["current"]
    response = httpx.put(f"{cadence_server.url}/admin/policy", json=body, headers=admin)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    after = httpx.get(f"{cadence_server.url}/admin/policy", headers=admin).json()["current"]
    assert after == before


def test_policy_listing_names_every_policy(cadence_server: RunningServer) -> None:
    body = httpx.get(
        f"{cadence_server.url}/admin/policy", headers=cadence_server.admin_headers()
    ).json()
    names = {p["name"] for p in body["available"]}
    assert {"fcfs", "stall_free", "priority", "fair", "slo"} <= names
    assert body["current"]["name"] in names


def test_state_reports_the_workers_kernels_and_cache(
    cadence_server: RunningServer, cadence_server_bf16: RunningServer
) -> None:
    # Which kernel wins is the machine's measurement; the bf16 chunk kernel is offered
    # only in bfloat16, on CPUs with AVX512-BF16.
    chunk_kernel = {"native"} if "avx512_bf16" in native.cpu_flags().split() else set()
    for server, dtype, offered in (
        (cadence_server, "float32", {"torch", "native-rows", "hybrid"}),
        (cadence_server_bf16, "bfloat16", {"torch", "native-rows", "hybrid"} | chunk_kernel),
    ):
        state = server.admin_state()
        assert state["kv_cache"]["dtype"] == dtype and state["kv_cache"]["block_size"] == 16
        kernels = state["kernels"]
        assert set(kernels["measured"]["attention"]) == offered
        for seam in ("attention", "layer_ops", "matmul"):
            assert isinstance(kernels["measured"][seam][kernels[seam]], float)


def swap_body(i: int) -> dict:
    return {
        "prompt": f"Stream {i}: describe the sea.",
        "max_tokens": 40,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,
    }


async def unswapped_references(client: httpx.AsyncClient) -> dict[int, dict]:
    """The same greedy requests, whole, with no swap (batch company does not change them)."""
    references: dict[int, dict] = {}

    async def one(i: int) -> None:
        response = await client.post("/v1/completions", json=swap_body(i))
        assert response.status_code == 200, response.text
        references[i] = response.json()

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, i)
    return references


async def test_live_swap_fcfs_to_stall_free_while_streams_run(
    server_of_each_dtype: RunningServer,
) -> None:
    server = server_of_each_dtype
    admin = server.admin_headers()
    async with httpx.AsyncClient(base_url=server.url, timeout=180) as client:
        original = (await client.get("/admin/policy", headers=admin)).json()["current"]
        put = await client.put("/admin/policy", json={"name": "fcfs"}, headers=admin)
        assert put.status_code == 200
        results: dict[int, server_fixtures.StreamResult] = {}
        first_chunks = [trio.Event() for _ in range(8)]

        async def one(i: int) -> None:
            body = {**swap_body(i), "stream_options": {"include_usage": True}}
            results[i] = await stream_completion(client, body, first_chunks[i])

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
            for event in first_chunks:
                await event.wait()
            swap = await client.put(
                "/admin/policy",
                headers=admin,
                json={"name": "stall_free", "params": {"token_budget": 256}},
            )
        restore = await client.put("/admin/policy", json=original, headers=admin)
        references = await unswapped_references(client)
    assert restore.status_code == 200
    assert swap.status_code == 200, swap.text
    swapped = swap.json()
    print("swap:", swapped)
    assert swapped["old"]["name"] == "fcfs" and swapped["new"]["name"] == "stall_free"
    assert swapped["new"]["params"]["token_budget"] == 256
    assert len(results) == 8
    for i, result in results.items():
        assert result.done and result.error is None and result.finish_reason == "length"
        assert result.usage["completion_tokens"] == 40 == result.streamed_tokens
        # content, not counts: no token lost, duplicated or reordered across the swap
        reference = references[i]["choices"][0]
        assert result.tokens == reference["logprobs"]["tokens"], f"stream {i}"
        assert result.text == reference["text"]
    iterations = server.log_events("iteration")
    at_swap = [e["policy"] for e in iterations if e["iteration"] >= swapped["iteration"]]
    assert at_swap and at_swap[0] == "stall_free"
    assert [e["policy"] for e in iterations if e["iteration"] == swapped["iteration"] - 1] == [
        "fcfs"
    ]
    changes = [
        e
        for e in server.log_events("admin.change")
        if e["new"]["name"] == "stall_free" and e["iteration"] == swapped["iteration"]
    ]
    assert changes and "token:" in changes[0]["who"] and "when" in changes[0]
