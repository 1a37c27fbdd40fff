"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from quart import Response

# HTTP status -> OpenAI error "type"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def error_type_for(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(
    message: str, status: int, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": error_type_for(status), "param": param, "code": code}
    }


@dataclass(slots=True)
class APIError(Exception):
    """Raised anywhere in a request handler; the app turns it into an OpenAI-shaped response."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, param=self.param, code=self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@contextlib.contextmanager
def params_renamed(names: dict[str, str]) -> Iterator[None]:
    """Errors raised for a request translated into another API's (a Responses or Messages
    body read as a chat) name the field of the body the client sent: `names` maps the
    other's field names to its."""
    try:
        yield
    except APIError as exc:
        exc.param = names.get(exc.param or "", exc.param)
        raise


def json_response(
    body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(body), status, {"Content-Type": "application/json", **(headers or {})}
    )
