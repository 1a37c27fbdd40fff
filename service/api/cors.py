"""Which web pages may call the API from a browser (CORS).

Nothing by default: the playground at / is same-origin and needs no CORS, and an answer of
`Access-Control-Allow-Origin: *` would let any page a user visits drive the server. With
--allowed-origins, those origins (or any, with "*") may call the public API (/v1/*, /health,
/metrics); /admin/* answers no CORS header to anyone. Preflights follow Starlette's
CORSMiddleware, which vLLM uses: a disallowed origin or method gets 400 and no allow headers.
"""

from __future__ import annotations

from dataclasses import dataclass

from quart import Response

from service.api.errors import error_body, json_response

ANY_ORIGIN = "*"
ALLOW_METHODS = ("GET", "POST")
EXPOSE_HEADERS = "Retry-After, X-Request-Id"
PREFLIGHT_MAX_AGE = "600"
PUBLIC_PATHS = ("/health", "/metrics")
PUBLIC_PREFIX = "/v1/"


def is_public_path(path: str) -> bool:
    """The routes a page on another origin may be allowed to call; never /admin."""
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX)


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    origins: frozenset[str]

    def allows(self, origin: str | None, path: str) -> bool:
        if origin is None or not is_public_path(path):
            return False
        return ANY_ORIGIN in self.origins or origin in self.origins

    def response_headers(self, origin: str | None, path: str) -> dict[str, str]:
        """CORS headers for an actual (not preflight) request's response."""
        if not is_public_path(path):
            return {}
        if not self.allows(origin, path):
            return self._vary()
        return {**self._origin_headers(origin), "Access-Control-Expose-Headers": EXPOSE_HEADERS}

    def preflight(
        self, origin: str, path: str, method: str, requested_headers: str | None
    ) -> Response:
        """The answer to an OPTIONS request carrying Access-Control-Request-Method."""
        if not self.allows(origin, path) or method.upper() not in ALLOW_METHODS:
            body = error_body(
                "disallowed CORS request: this origin, path or method is not allowed",
                400,
                code="cors_not_allowed",
            )
            return json_response(body, 400, self._vary())
        headers = {
            **self._origin_headers(origin),
            "Access-Control-Allow-Methods": ", ".join(ALLOW_METHODS),
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
        }
        if requested_headers:
            # Any request header, as vLLM allows by default: OpenAI's SDKs send their own.
            headers["Access-Control-Allow-Headers"] = requested_headers
        return Response(b"", 204, headers)

    def _origin_headers(self, origin: str | None) -> dict[str, str]:
        if ANY_ORIGIN in self.origins:
            return {"Access-Control-Allow-Origin": ANY_ORIGIN}
        assert origin is not None
        return {"Access-Control-Allow-Origin": origin, **self._vary()}

    def _vary(self) -> dict[str, str]:
        # The answer depends on the Origin header unless every origin gets the same one.
        return {} if ANY_ORIGIN in self.origins or not self.origins else {"Vary": "Origin"}
