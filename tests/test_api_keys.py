"""API keys, the Host check and tenants that are who they say, on a real server.

One server with keys from --api-key-file (team-a may set `priority`, team-b may not; the
team-c key and the team-d tenant have connection caps):
no key or a wrong one gets 401 in OpenAI's shape on every route but /health and the page;
the official `openai` client works with a key, and Anthropic's with it as `x-api-key`; a
rebound Host gets 421; a request's tenant is its key's (a client's `user` only a
sub-tenant); the prefix cache is shared within a tenant and never across; `cached_tokens`
is not reported; `priority` only from team-a; a connection past a key's or a tenant's cap
gets 429 while its stream in flight goes on.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import trio

from ops.corpus import full_text
from service.api.access import HostCheck, KeyRing
from service.cli import add_serve_args, config_from_args, parse_api_key_file
from service.config import ApiKey, Config
from tests.server_fixtures import RunningServer, seconds_until, start_server, stop_server

KEY_A, KEY_B = "sk-team-a-0123456789", "sk-team-b-9876543210"
KEY_C, KEY_D1, KEY_D2 = "sk-team-c-capped-01", "sk-team-d-one-0001", "sk-team-d-two-0002"
KEY_FILE = f"""# key tenant options
{KEY_A} team-a priority,metrics
{KEY_B} team-b
{KEY_C} team-c connections=2
{KEY_D1} team-d tenant-connections=2
{KEY_D2} team-d
"""
SAY_HI = [{"role": "user", "content": "Say hi."}]
KEYED_ROUTES = [
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- without a server ---------------------------------------------------------------------


def serve_config(*argv: str) -> Config:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_the_key_file_names_tenants_and_permissions() -> None:
    keys = parse_api_key_file(KEY_FILE + "sk-lonely\n\n  # nothing\nsk-m t metrics\n")
    assert [(k.key, k.tenant, k.may_set_priority, k.may_read_metrics) for k in keys] == [
        (KEY_A, "team-a", True, True),
        (KEY_B, "team-b", False, False),
        (KEY_C, "team-c", False, False),
        (KEY_D1, "team-d", False, False),
        (KEY_D2, "team-d", False, False),
        ("sk-lonely", keys[5].tenant, False, False),
        ("sk-m", "t", False, True),
    ]
    # a tenant's cap, given on one of its lines, holds for every key of it
    caps = [(k.max_connections, k.tenant_max_connections) for k in keys]
    assert caps == [(None, None)] * 2 + [(2, None), (None, 2), (None, 2)] + [(None, None)] * 2
    assert keys[5].tenant.startswith("key-") and "lonely" not in keys[5].tenant
    assert "sk-team" not in repr(keys)  # a key never shows in a log line or a traceback
    bad_lines = (
        *("k a/b", "k t admin", "k t priority,admin", "k t priority extra", f"k {'t' * 65}"),
        *("k t connections=0", "k t connections=x", "k t metrics=2", "k t priority,connections"),
    )
    for bad in bad_lines:
        with pytest.raises(ValueError, match="line 1"):
            parse_api_key_file(bad)
    with pytest.raises(ValueError, match="'t': two different tenant-connections caps"):
        parse_api_key_file("k1 t tenant-connections=2\nk2 t tenant-connections=3")


def test_keys_come_from_the_flag_the_file_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_FILE)
    monkeypatch.setenv("CADENCE_API_KEY", "sk-env")
    config = serve_config(
        "--api-key", "sk-flag", "--api-key", "sk-two", "--api-key-file", str(key_file)
    )
    file_keys = [KEY_A, KEY_B, KEY_C, KEY_D1, KEY_D2]
    assert [k.key for k in config.api_keys] == ["sk-flag", "sk-two", "sk-env", *file_keys]
    assert config.isolates_tenants() and not config.reports_cached_tokens()
    monkeypatch.delenv("CADENCE_API_KEY")
    open_config = serve_config()
    assert open_config.api_keys == []
    assert not open_config.isolates_tenants() and open_config.reports_cached_tokens()
    chosen = serve_config("--cache-isolation", "tenant", "--enable-prompt-tokens-details")
    assert chosen.isolates_tenants() and chosen.reports_cached_tokens()


def test_a_key_is_found_only_by_its_exact_value() -> None:
    ring = KeyRing((ApiKey("abc", "t1"), ApiKey("abcd", "t2")))
    assert ring.find("abc").tenant == "t1"
    assert ring.find("abcd").tenant == "t2"
    assert ring.find("ab") is None and ring.find("abcde") is None and ring.find("") is None


def test_loopback_servers_answer_only_to_loopback_names() -> None:
    loopback = HostCheck.of(Config(host="127.0.0.1"))
    for host in ("localhost", "LOCALHOST:8000", "127.0.0.1:1", "[::1]", "[::1]:8000", None):
        assert loopback.allows(host), host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "::1"):
        assert not loopback.allows(host), host
    assert HostCheck.of(Config(host="0.0.0.0")).allows("any.example")
    named = HostCheck.of(Config(allowed_hosts=["api.example", "other.example:443"]))
    assert named.allows("api.example:8000") and named.allows("other.example:443")
    assert not named.allows("other.example:80") and not named.allows("localhost")
    assert HostCheck.of(Config(allowed_hosts=["*"])).allows("anything")


# ---- a real server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log_dir = tmp_path_factory.mktemp("keyed-server")
    (log_dir / "keys").write_text(KEY_FILE)
    server = start_server(log_dir, "--api-key-file", str(log_dir / "keys"), wait=False)
    try:
        server.wait_healthy()
        models = httpx.get(f"{server.url}/v1/models", headers=bearer(KEY_A), timeout=10)
        server.model = models.json()["data"][0]["id"]
    except BaseException:
        stop_server(server)
        raise
    yield server
    stop_server(server)


@pytest.mark.real_model
@pytest.mark.parametrize("key", [None, "sk-wrong", KEY_A + "x", KEY_A[:-1]])
def test_every_route_but_health_and_the_page_wants_a_key(
    keyed_server: RunningServer, key: str | None
) -> None:
    headers = {} if key is None else bearer(key)
    with httpx.Client(base_url=keyed_server.url, timeout=30) as client:
        for method, path, body in KEYED_ROUTES:
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (path, response.text)
            error = response.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            assert "Authorization: Bearer" in error["message"]
            assert response.headers["WWW-Authenticate"] == "Bearer"
        assert client.get("/health", headers=headers).status_code == 200
        assert client.get("/", headers=headers).status_code == 200


@pytest.mark.real_model
def test_the_openai_client_needs_the_key(keyed_server: RunningServer) -> None:
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=key, max_retries=0)

    with pytest.raises(openai.AuthenticationError):
        client("sk-wrong").models.list()
    answer = client(KEY_B).chat.completions.create(
        model=keyed_server.model,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        temperature=0,
    )
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens_details is None  # cached_tokens not reported


@pytest.mark.real_model
def test_the_anthropic_client_sends_its_key_as_x_api_key(keyed_server: RunningServer) -> None:
    """The same keys and tenants; `metadata.user_id` a sub-tenant, as `user` is."""

    def client(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=keyed_server.url, api_key=key, max_retries=0)

    with pytest.raises(anthropic.AuthenticationError) as refused:
        client("sk-wrong").messages.count_tokens(model=keyed_server.model, messages=SAY_HI)
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": refused.value.body["error"]["message"],
        },
    }
    assert "x-api-key" in refused.value.body["error"]["message"]
    answer = client(KEY_B).messages.create(
        model=keyed_server.model, max_tokens=2, messages=SAY_HI, metadata={"user_id": "bob"}
    )
    assert answer.content and answer.usage.output_tokens <= 2
    (received,) = [
        e for e in keyed_server.log_events("request.received") if e["request_id"] == answer.id
    ]
    assert received["tenant"] == "team-b/bob"


@pytest.mark.real_model
def test_the_admin_routes_keep_their_own_token(keyed_server: RunningServer) -> None:
    assert keyed_server.admin_state()["worker_ready"]  # the admin token, no API key
    response = httpx.get(f"{keyed_server.url}/admin/state", headers=bearer(KEY_A), timeout=10)
    assert response.status_code == 403  # an API key is no admin token


@pytest.mark.real_model
def test_metrics_answer_only_the_admin_token_and_keys_granted_them(
    keyed_server: RunningServer,
) -> None:
    def metrics(headers: dict[str, str]) -> httpx.Response:
        return httpx.get(f"{keyed_server.url}/metrics", headers=headers, timeout=10)

    refused = metrics(bearer(KEY_B))  # the prefix cache's hits are every tenant's
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "metrics_not_allowed"
    for allowed in (bearer(KEY_A), keyed_server.admin_headers()):
        answer = metrics(allowed)
        assert answer.status_code == 200 and "cadence:prefix_cache_hits_total" in answer.text


@pytest.mark.real_model
def test_the_openapi_document_declares_the_key(keyed_server: RunningServer) -> None:
    doc = httpx.get(f"{keyed_server.url}/openapi.json", headers=bearer(KEY_A), timeout=10).json()
    assert doc["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"apiKey": []}]
    assert "401" in doc["paths"]["/tokenize"]["post"]["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]


@pytest.mark.real_model
@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "localhost.evil.example"])
def test_a_rebound_host_gets_421_on_every_route(keyed_server: RunningServer, host: str) -> None:
    with httpx.Client(base_url=keyed_server.url, timeout=30) as client:
        for method, path, body in [*KEYED_ROUTES, ("GET", "/health", None), ("GET", "/", None)]:
            headers = {**bearer(KEY_A), "Host": host}
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 421, (path, response.text)
            assert response.json()["error"]["code"] == "misdirected_request"
        port = keyed_server.url.rsplit(":", 1)[1]
        for name in ("localhost", f"localhost:{port}", "[::1]"):
            response = client.get("/v1/models", headers={**bearer(KEY_A), "Host": name})
            assert response.status_code == 200, name


def generate(server: RunningServer, key: str, body: dict, **headers: str) -> httpx.Response:
    body = {"model": server.model, "max_tokens": 1, "temperature": 0, **body}
    return httpx.post(
        f"{server.url}/v1/completions", json=body, headers={**bearer(key), **headers}, timeout=120
    )


@pytest.mark.real_model
def test_a_requests_tenant_is_its_keys(keyed_server: RunningServer) -> None:
    generate(keyed_server, KEY_A, {"prompt": "tenant probe one"}).raise_for_status()
    generate(keyed_server, KEY_A, {"prompt": "tenant probe two", "user": "alice"})
    generate(keyed_server, KEY_B, {"prompt": "tenant probe three"}, **{"X-Tenant": "team-a"})
    received = {e["request_id"]: e for e in keyed_server.log_events("request.received")}
    finished = keyed_server.log_events("request.finished")[-3:]
    assert [received[e["request_id"]]["tenant"] for e in finished] == [
        "team-a",
        "team-a/alice",
        "team-b/team-a",  # naming another tenant only names a sub-tenant of one's own
    ]


@pytest.mark.real_model
def test_priority_only_from_keys_allowed_to_set_it(keyed_server: RunningServer) -> None:
    refused = generate(keyed_server, KEY_B, {"prompt": "urgent", "priority": -1000000})
    assert refused.status_code == 403
    assert refused.json()["error"]["param"] == "priority"
    assert refused.json()["error"]["code"] == "priority_not_allowed"
    assert generate(keyed_server, KEY_B, {"prompt": "calm", "priority": 0}).status_code == 200
    allowed = generate(keyed_server, KEY_A, {"prompt": "urgent", "priority": -1000000})
    assert allowed.status_code == 200


def hits(server: RunningServer) -> int:
    return server.admin_state()["prefix_cache"]["hits_tokens"]


@pytest.mark.real_model
def test_the_prefix_cache_is_shared_within_a_tenant_never_across(
    keyed_server: RunningServer,
) -> None:
    prompt = "[isolation]\n" + full_text()[:1500]
    generate(keyed_server, KEY_A, {"prompt": prompt}).raise_for_status()
    before = hits(keyed_server)
    # another tenant, even with a cache_salt of its choosing, finds nothing of team-a's
    generate(keyed_server, KEY_B, {"prompt": prompt}).raise_for_status()
    generate(keyed_server, KEY_B, {"prompt": prompt, "cache_salt": "team-a"}).raise_for_status()
    assert hits(keyed_server) == before
    # a sub-tenant of team-a shares team-a's prefix; a salt of team-a's own narrows it
    generate(keyed_server, KEY_A, {"prompt": prompt, "user": "bob"}).raise_for_status()
    shared = hits(keyed_server) - before
    assert shared >= 300
    generate(keyed_server, KEY_A, {"prompt": prompt, "cache_salt": "private"}).raise_for_status()
    assert hits(keyed_server) - before == shared


def metric(server: RunningServer, name: str, tenant: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=bearer(KEY_A), timeout=10).text
    match = re.search(rf'^cadence:{name}{{tenant="{tenant}"}} (\S+)$', text, re.M)
    assert match, f"cadence:{name} of {tenant} missing"
    return float(match.group(1))


@pytest.mark.real_model
async def test_a_tenants_flood_gets_429_while_another_tenant_is_admitted(
    keyed_server: RunningServer,
) -> None:
    state = keyed_server.admin_state()
    total, block = state["kv_cache"]["num_blocks"], state["kv_cache"]["block_size"]
    n = 32
    # one request of team-a reserves ~40 % of the blocks: a second passes its half
    max_tokens = int(0.4 * total / n) * block - 8
    flood = {
        "model": keyed_server.model,
        "prompt": "flood",
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "stream": True,
    }
    url = keyed_server.url
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        trio.open_nursery() as nursery,
    ):
        streaming = trio.Event()

        async def hold_the_flood() -> None:
            async with client.stream(
                "POST", "/v1/completions", json=flood, headers=bearer(KEY_A)
            ) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    streaming.set()

        nursery.start_soon(hold_the_flood)
        await streaming.wait()
        reserved = metric(keyed_server, "tenant_kv_blocks_reserved", "team-a")
        assert reserved >= 0.4 * total - n
        second = await client.post(
            "/v1/completions", json={**flood, "stream": False}, headers=bearer(KEY_A)
        )
        other = await client.post(
            "/v1/completions",
            json={"model": keyed_server.model, "prompt": "calm", "max_tokens": 2},
            headers=bearer(KEY_B),
        )
        nursery.cancel_scope.cancel()
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "overloaded"
    assert "team-a" in second.json()["error"]["message"]
    assert int(second.headers["Retry-After"]) >= 1
    assert other.status_code == 200, other.text
    assert metric(keyed_server, "tenant_kv_blocks_reserved", "team-b") == 0
    assert keyed_server.wait_idle()["kv_blocks_used"] == 0


def refused_for_connections(response: httpx.Response) -> str:
    """The 429's message, once its shape is checked: the refused connection is closed."""
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "too_many_connections"
    assert response.headers["connection"] == "close"
    return response.json()["error"]["message"]


@pytest.mark.real_model
def test_a_connection_past_its_keys_cap_is_refused_and_the_stream_goes_on(
    keyed_server: RunningServer,
) -> None:
    """team-c's key may hold 2 connections: with a stream in flight on one and an idle one
    beside it, a third gets 429; the stream ends whole, and a key of another tenant is
    served. Once they close, the key connects again."""
    url, body = keyed_server.url, {"model": keyed_server.model, "prompt": "Count:"}
    body |= {"max_tokens": 8, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=url, timeout=60) as streams,
        httpx.Client(base_url=url, timeout=60) as idle,
        httpx.Client(base_url=url, timeout=60) as third,
    ):
        with streams.stream("POST", "/v1/completions", json=body, headers=bearer(KEY_C)) as s:
            events = (line for line in s.iter_lines() if line)
            assert next(events).startswith("data: {")  # in flight
            assert idle.get("/v1/models", headers=bearer(KEY_C)).status_code == 200
            refusal = refused_for_connections(third.get("/v1/models", headers=bearer(KEY_C)))
            assert "this API key has 2 connections open" in refusal
            assert third.get("/v1/models", headers=bearer(KEY_B)).status_code == 200
            rest = list(events)
        assert s.status_code == 200 and rest[-1] == "data: [DONE]"
        assert sum('"text"' in event for event in rest) >= 7  # every token came
    seconds_until(lambda: httpx.get(f"{url}/v1/models", headers=bearer(KEY_C)).is_success, 5)


@pytest.mark.real_model
def test_a_tenants_cap_counts_the_connections_of_all_its_keys(
    keyed_server: RunningServer,
) -> None:
    url = keyed_server.url
    clients = [httpx.Client(base_url=url, timeout=30) for _ in range(3)]
    try:
        for client, key in zip(clients[:2], (KEY_D1, KEY_D2), strict=True):
            assert client.get("/v1/models", headers=bearer(key)).status_code == 200
        refusal = refused_for_connections(clients[2].get("/v1/models", headers=bearer(KEY_D2)))
        assert "tenant 'team-d' has 2 connections open" in refusal
        # a connection already counted is served on: the cap refuses newcomers only
        assert clients[0].get("/v1/models", headers=bearer(KEY_D1)).status_code == 200
    finally:
        for client in clients:
            client.close()
