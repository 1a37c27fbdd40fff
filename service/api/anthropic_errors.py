"""Errors in Anthropic's shape, {"type": "error", "error": {"type", "message"}}, for every
error answered on the Messages routes: their own, and those the shared code raises before
them (API keys, the Host check, the body's limits, admission), so that Anthropic's SDKs
read each as the exception its status names."""

from __future__ import annotations

from typing import Any

MESSAGES_PATH = "/v1/messages"
# HTTP status -> Anthropic's error type
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def answers_anthropic(path: str) -> bool:
    """Whether a request's errors are Anthropic's (its Messages routes') or OpenAI's."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
