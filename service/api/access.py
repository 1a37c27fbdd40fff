"""Who may call the server: the Host check against DNS rebinding, and the API keys.

DNS rebinding: a page on an attacker's name that resolves, after it loaded, to 127.0.0.1
is same-origin with itself, so CORS and the JSON-only rule do not stop its requests to a
loopback server; only the `Host` header it must send (its own name) gives it away. A request
whose Host is not an allowed name gets 421 before anything else runs.

API keys: with --api-key, --api-key-file or $CADENCE_API_KEY set, every route but /health
and the playground page wants `Authorization: Bearer KEY` (401 in OpenAI's shape without
one that matches; `x-api-key: KEY`, as Anthropic's SDKs send it, is
the same). The admin routes keep their own token, which is the stronger one. The
key names the request's tenant: a client's `user` or `X-Tenant` only names a sub-tenant
inside it, so one key's clients cannot pose as another's.

Connection caps: a key (or its tenant) with one in --api-key-file gets 429
`too_many_connections` on a request that would open one connection more than its cap, and
that connection closed (service.connections); its other connections are untouched.

/metrics with keys: its counters are the whole server's, every tenant's (the prefix cache's
hits would tell one tenant what others sent), so it answers only the admin token (what a
Prometheus scrape sends) and keys granted `metrics` in --api-key-file; other keys get 403.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from quart import g, request
from quart_trio import QuartTrio

from service.api.errors import APIError
from service.api.routes_admin import bearer_token, is_admin_token
from service.config import ApiKey, Config
from service.connections import Connections

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
LOOPBACK_BINDS = ("localhost", "127.0.0.1", "::1", "[::1]")
ANY_HOST = "*"
# Never behind a key: probes must reach /health, and the page itself holds no secret.
OPEN_PATHS = frozenset({"/health", "/"})
# Behind the admin token instead (routes_admin.require_admin).
ADMIN_PATHS = ("/admin/", "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
METRICS_PATH = "/metrics"
ANTHROPIC_KEY_HEADER = "x-api-key"  # how Anthropic's SDKs send the key


@dataclass(frozen=True, slots=True)
class HostCheck:
    """Host header names served; an entry without a port allows any port."""

    allowed: frozenset[str] | None  # None: any host

    @classmethod
    def of(cls, config: Config) -> HostCheck:
        hosts = config.allowed_hosts
        if hosts is None:
            loopback = config.host.lower() in LOOPBACK_BINDS
            return cls(frozenset(LOOPBACK_HOSTS) if loopback else None)
        return cls(None if ANY_HOST in hosts else frozenset(h.lower() for h in hosts))

    def allows(self, host: str | None) -> bool:
        if self.allowed is None or host is None:
            return True  # no Host at all (HTTP/1.0): no browser sends that
        host = host.lower()
        return host in self.allowed or _without_port(host) in self.allowed


def _without_port(host: str) -> str:
    name, sep, port = host.rpartition(":")
    if not sep or not port.isdigit() or (name.startswith("[") != name.endswith("]")):
        return host  # no port, or a bare IPv6 address's last group
    return name


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The API keys; `find` takes as long whichever key matches, or none."""

    keys: tuple[ApiKey, ...]

    def find(self, given: str) -> ApiKey | None:
        # Equal-length digests, each compared in constant time, every key every time:
        # neither the key's length nor which one matched shows in the answer's timing.
        digest = hashlib.sha256(given.encode()).digest()
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, hashlib.sha256(key.key.encode()).digest()):
                found = key
        return found


def install_host_check(app: QuartTrio, config: Config) -> None:
    """Install first: a rebound page gets nothing at all, not even a CORS preflight."""
    hosts = HostCheck.of(config)

    @app.before_request
    async def check_host() -> None:
        if not hosts.allows(request.headers.get("Host")):
            raise APIError(
                421,
                "this server does not answer to that Host name (see --allowed-hosts)",
                code="misdirected_request",
            )


def install_api_keys(app: QuartTrio, config: Config) -> None:
    """Install after the CORS preflight's answer (a preflight carries no credentials)."""
    ring = KeyRing(tuple(config.api_keys))

    @app.before_request
    async def check_api_key() -> None:
        if not ring.keys or not needs_key(request.path):
            return
        given = bearer_token() or request.headers.get(ANTHROPIC_KEY_HEADER)
        if request.path == METRICS_PATH and is_admin_token(given, config.admin_token):
            return
        key = None if given is None else ring.find(given)
        if key is None:
            raise APIError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>' "
                f"(or '{ANTHROPIC_KEY_HEADER}: <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        refusal = Connections.claim(request.scope.get("client"), key)
        if refusal is not None:
            raise APIError(
                429,
                refusal,
                code="too_many_connections",
                headers={"Connection": "close", "Retry-After": "1"},
            )
        if request.path == METRICS_PATH and not key.may_read_metrics:
            raise APIError(
                403,
                "this API key may not read /metrics, which shows every tenant's counters: "
                "scrape with the admin token, or grant the key `metrics` in --api-key-file",
                code="metrics_not_allowed",
            )
        g.api_key = key


def request_key() -> ApiKey | None:
    """The key the current request came with; None when the server has no keys."""
    return g.get("api_key")


def needs_key(path: str) -> bool:
    return path not in OPEN_PATHS and not path.startswith(ADMIN_PATHS)
