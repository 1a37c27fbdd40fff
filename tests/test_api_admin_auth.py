"""Admin authentication without a model: the bearer-token check, unit by unit and over HTTP.

tests/test_api_admin.py covers the same endpoints on a real server (slow, `real_model`).
Here `require_admin`, `bearer_token` and `admin_identity` run inside a tiny Quart-Trio
request context, and the admin routes run in the real app on an engine whose worker is
never started, so every token shape can be tried in milliseconds: a token that is a
prefix of the real one, one that extends it and one that differs only in case must all
get 403, exactly like any other wrong token.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from quart_trio import QuartTrio

from service.api import routes_admin
from service.api.app import create_app
from service.api.app_state import EXTENSION_KEY, AppState
from service.api.errors import APIError
from service.config import Config
from service.engine.engine import Engine
from tests.sim_worker import SimTokenizer, SimWorker

TOKEN = "s3cret-Admin-token"
WRONG_TOKENS = [
    "wrong-token",
    TOKEN[:-1],  # a prefix of the real one
    TOKEN[:1],
    TOKEN + "x",  # extends the real one
    TOKEN.upper(),  # the same letters, another case
    TOKEN.lower(),
    TOKEN.swapcase(),
]


def make_state(admin_token: str | None) -> AppState:
    config = Config(admin_token=admin_token, policy="fcfs")
    engine = Engine(config, SimWorker(), SimTokenizer())
    return AppState(config, engine, SimTokenizer(), "sim", metrics=None)  # type: ignore[arg-type]


@asynccontextmanager
async def admin_request(
    authorization: str | None, admin_token: str | None = TOKEN, remote_addr: str | None = None
) -> AsyncIterator[AppState]:
    """A request context for GET /admin/state carrying the given Authorization header."""
    app = QuartTrio(__name__)
    state = make_state(admin_token)
    app.extensions[EXTENSION_KEY] = state
    headers = {} if authorization is None else {"Authorization": authorization}
    if remote_addr is not None:
        headers["Remote-Addr"] = remote_addr  # where Quart reads the client address from
    async with app.test_request_context("/admin/state", headers=headers):
        yield state


def raised(call: Callable[[], Any]) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


# ---- require_admin ----------------------------------------------------------------------


async def test_the_right_token_returns_the_app_state():
    async with admin_request(f"Bearer {TOKEN}") as state:
        assert routes_admin.require_admin() is state


@pytest.mark.parametrize("given", WRONG_TOKENS)
async def test_any_other_token_is_rejected_with_403(given: str):
    async with admin_request(f"Bearer {given}"):
        error = raised(routes_admin.require_admin)
    assert error.status == 403
    assert error.code == "invalid_token"
    assert TOKEN not in error.message  # the real token is never echoed back


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", "Bearer    "])
async def test_a_missing_bearer_token_gets_401_with_a_challenge(authorization: str | None):
    async with admin_request(authorization):
        error = raised(routes_admin.require_admin)
    assert error.status == 401
    assert error.code == "missing_token"
    assert error.headers == {"WWW-Authenticate": "Bearer"}
    assert "Authorization: Bearer" in error.message  # tells the client what to send


@pytest.mark.parametrize("authorization", [f"Basic {TOKEN}", f"Token {TOKEN}", TOKEN])
async def test_a_token_under_another_scheme_counts_as_missing(authorization: str):
    async with admin_request(authorization):
        error = raised(routes_admin.require_admin)
    assert error.status == 401


@pytest.mark.parametrize("admin_token", [None, ""])
@pytest.mark.parametrize("authorization", [None, f"Bearer {TOKEN}", "Bearer "])
async def test_admin_is_disabled_without_a_configured_token(
    admin_token: str | None, authorization: str | None
):
    async with admin_request(authorization, admin_token=admin_token):
        error = raised(routes_admin.require_admin)
    assert error.status == 403
    assert error.code == "admin_disabled"
    # tells the operator both ways to turn it on
    assert "--admin-token" in error.message and "CADENCE_ADMIN_TOKEN" in error.message


async def test_a_non_ascii_token_is_compared_without_crashing():
    async with admin_request("Bearer s3cret-Admin-tokén"):
        assert raised(routes_admin.require_admin).status == 403


# ---- bearer_token -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("authorization", "token"),
    [
        (f"Bearer {TOKEN}", TOKEN),
        (f"bearer {TOKEN}", TOKEN),  # the scheme is case-insensitive (RFC 7235)
        (f"BEARER {TOKEN}", TOKEN),
        (f"Bearer   {TOKEN}  ", TOKEN),  # surrounding blanks are not part of the token
        ("Bearer a b", "a b"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer  ", None),
        (f"Basic {TOKEN}", None),
        (f"Bearer{TOKEN}", None),
    ],
)
async def test_bearer_token_extracts_the_token_of_the_bearer_scheme_only(
    authorization: str | None, token: str | None
):
    async with admin_request(authorization):
        assert routes_admin.bearer_token() == token


async def test_the_token_keeps_its_case():
    async with admin_request(f"Bearer {TOKEN}"):
        assert routes_admin.bearer_token() == TOKEN
        assert routes_admin.require_admin() is not None


# ---- admin_identity ---------------------------------------------------------------------


def fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


async def test_identity_is_the_address_and_a_fingerprint_that_hides_the_token():
    async with admin_request(f"Bearer {TOKEN}", remote_addr="10.1.2.3"):
        who = routes_admin.admin_identity()
    assert who == f"10.1.2.3 token:{fingerprint(TOKEN)}"
    assert TOKEN not in who


async def test_identity_without_an_address_or_token_still_names_something():
    async with admin_request(None):
        assert routes_admin.admin_identity() == f"- token:{fingerprint('')}"


async def test_different_tokens_have_different_fingerprints():
    async with admin_request("Bearer one", remote_addr="h"):
        first = routes_admin.admin_identity()
    async with admin_request("Bearer two", remote_addr="h"):
        second = routes_admin.admin_identity()
    assert first != second


# ---- over HTTP, in the real app (engine not started, so no worker and no model) -------------


@pytest.fixture
def client():
    config = Config(admin_token=TOKEN, policy="fcfs")
    engine = Engine(config, SimWorker(), SimTokenizer())
    app = create_app(config, engine, SimTokenizer(), "sim")  # type: ignore[arg-type]
    return app.test_client()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/admin/policy", None),
        ("GET", "/admin/state", None),
        ("PUT", "/admin/policy", {"name": "stall_free"}),
    ],
)
@pytest.mark.parametrize("given", WRONG_TOKENS)
async def test_every_admin_endpoint_answers_a_wrong_token_with_403(
    client, method: str, path: str, body: dict | None, given: str
):
    response = await client.open(path, method=method, json=body, headers=bearer(given))
    assert response.status_code == 403
    error = (await response.get_json())["error"]
    assert error["code"] == "invalid_token" and error["type"] == "permission_error"


async def test_the_401_response_carries_the_bearer_challenge(client):
    response = await client.get("/admin/state")
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert (await response.get_json())["error"]["type"] == "authentication_error"


async def test_a_wrong_token_changes_no_policy(client):
    response = await client.put("/admin/policy", json={"name": "slo"}, headers=bearer(TOKEN[:-1]))
    assert response.status_code == 403
    current = await (await client.get("/admin/policy", headers=bearer(TOKEN))).get_json()
    assert current["current"]["name"] == "fcfs"


async def test_the_right_token_reads_state_and_swaps_the_policy(client):
    response = await client.get("/admin/state", headers=bearer(TOKEN))
    assert response.status_code == 200
    state = await response.get_json()
    assert state["policy"]["name"] == "fcfs" and state["worker_pid"] is None

    response = await client.get("/admin/policy", headers=bearer(TOKEN))
    body = await response.get_json()
    assert body["current"]["name"] == "fcfs"
    assert {p["name"] for p in body["available"]} >= {"fcfs", "stall_free", "slo"}

    response = await client.put(
        "/admin/policy",
        json={"name": "stall_free", "params": {"chunk_size": 64}},
        headers=bearer(TOKEN),
    )
    assert response.status_code == 200
    swap = await response.get_json()
    assert swap["old"]["name"] == "fcfs"
    assert swap["new"] == {
        "name": "stall_free",
        "params": {
            "token_budget": 512,
            "max_prefill_share": 1.0,
            "chunk_size": 64,
            "solo_budget": 2048,
            "bound_cost": True,
            "max_adapters_per_step": 0,
        },
    }
    assert swap["iteration"] == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"not json", None),
        (b"[1]", None),
        (orjson.dumps({"name": "fcfs", "extra": 1}), "extra"),
        (orjson.dumps({"name": ""}), "name"),
        (orjson.dumps({"name": 3}), "name"),
        (orjson.dumps({"name": ["fcfs"]}), "name"),
        (orjson.dumps({"name": {"fcfs": 1}}), "name"),
        (orjson.dumps({"name": None}), "name"),
        (orjson.dumps({"params": {}}), "name"),
        (orjson.dumps({"name": "fcfs", "params": [1]}), "params"),
        (orjson.dumps({"name": "lifo"}), "name"),  # unknown policy
        (orjson.dumps({"name": "fcfs", "params": {"bogus": 1}}), "params"),
    ],
)
async def test_a_bad_policy_body_gets_400_naming_the_field(client, body: bytes, param: str | None):
    headers = {**bearer(TOKEN), "Content-Type": "application/json"}
    response = await client.put("/admin/policy", data=body, headers=headers)
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    current = await (await client.get("/admin/policy", headers=bearer(TOKEN))).get_json()
    assert current["current"]["name"] == "fcfs"  # nothing changed


async def test_metrics_need_no_token(client):
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert b"fcfs" in await response.get_data()


async def test_an_unparseable_integer_string_in_params_gets_400(client):
    body = {"name": "stall_free", "params": {"token_budget": "--5"}}
    response = await client.put("/admin/policy", json=body, headers=bearer(TOKEN))
    assert response.status_code == 400
