"""Operator endpoints behind a bearer token: policy hot swap, engine state; and /metrics."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import orjson
import structlog
from quart import Blueprint, Response, request

from policies.base import PolicyError
from policies.registry import describe_policies
from service.api.app_state import AppState, app_state
from service.api.body import read_body
from service.api.errors import APIError, bad_request, json_response
from service.api.metrics import CONTENT_TYPE

blueprint = Blueprint("admin", __name__)
log = structlog.get_logger("cadence.admin")


@blueprint.get("/metrics")
async def metrics() -> Response:
    state = app_state()
    engine_state = {**state.engine.state(), "tenants": state.engine.tenant_load()}
    return Response(state.metrics.render(engine_state), 200, {"Content-Type": CONTENT_TYPE})


@blueprint.get("/admin/policy")
async def get_policy() -> Response:
    engine = require_admin().engine
    return json_response({"current": engine.policy_info(), "available": describe_policies()})


@blueprint.put("/admin/policy")
async def put_policy() -> Response:
    state = require_admin()
    who = admin_identity()
    name, params = parse_policy_body(await read_body())
    try:
        swap = state.engine.set_policy(name, params, by=who)
    except PolicyError as exc:
        param = "name" if name not in {p["name"] for p in describe_policies()} else "params"
        raise bad_request(str(exc), param, "invalid_policy") from None
    log.info(
        "admin.change",
        who=who,
        what="policy",
        old=swap.old,
        new=swap.new,
        iteration=swap.iteration,
        when=time.time(),
    )
    return json_response({"old": swap.old, "new": swap.new, "iteration": swap.iteration})


@blueprint.get("/admin/state")
async def get_state() -> Response:
    engine = require_admin().engine
    body = dict(engine.state())
    handshake = engine.handshake
    body["worker_pid"] = handshake.pid if handshake is not None else None
    # Each rank of a tensor-parallel worker, rank 0 first: its pid, device and KV bytes.
    body["worker_ranks"] = handshake.ranks if handshake is not None else None
    # The kernels the worker chose at its start, with every candidate's measured time.
    body["kernels"] = handshake.kernels if handshake is not None else None
    body["quantization"] = handshake.quantization if handshake is not None else None
    return json_response(body)


@blueprint.post("/reset_prefix_cache")
async def reset_prefix_cache() -> Response:
    """vLLM's endpoint: forget every cached prefix (blocks in use stay with their
    requests, unshared from now on); for benchmarks that must start cold."""
    state = require_admin()
    cached = state.engine.reset_prefix_cache()
    log.info(
        "admin.change",
        who=admin_identity(),
        what="prefix_cache",
        old=cached,
        new=0,
        when=time.time(),
    )
    return json_response({"reset_blocks": cached})


def parse_policy_body(data: bytes) -> tuple[str, dict[str, Any] | None]:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - {"name", "params"})
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}; expected 'name' and 'params'", unknown[0])
    name, params = body.get("name"), body.get("params")
    if not isinstance(name, str) or not name:
        raise bad_request("'name' must be a policy name", "name")
    if params is not None and not isinstance(params, dict):
        raise bad_request("'params' must be an object", "params")
    return name, params


def require_admin() -> AppState:
    """401 without a bearer token, 403 with a wrong one or when admin is disabled."""
    state = app_state()
    expected = state.config.admin_token
    if not expected:
        raise APIError(
            403,
            "the admin API is disabled: start the server with --admin-token "
            "or the CADENCE_ADMIN_TOKEN environment variable",
            code="admin_disabled",
        )
    given = bearer_token()
    if given is None:
        raise APIError(
            401,
            "missing bearer token: send 'Authorization: Bearer <admin token>'",
            code="missing_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not is_admin_token(given, expected):
        raise APIError(403, "the admin token is wrong", code="invalid_token")
    return state


def is_admin_token(given: str | None, admin_token: str | None) -> bool:
    """Compared in constant time; never true while the admin API is disabled."""
    if given is None or not admin_token:
        return False
    return hmac.compare_digest(given.encode(), admin_token.encode())


def bearer_token() -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def admin_identity() -> str:
    """Who made a change: client address plus a fingerprint that does not reveal the token."""
    token = bearer_token() or ""
    fingerprint = hashlib.sha256(token.encode()).hexdigest()[:12]
    return f"{request.remote_addr or '-'} token:{fingerprint}"
