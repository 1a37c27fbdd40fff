"""LoRA adapters in the API: a request's `model` naming one, and vLLM's admin routes that
load and unload them at run time (POST /v1/load_lora_adapter {lora_name, lora_path},
POST /v1/unload_lora_adapter {lora_name}, behind the admin token).

Unloading takes the name out of the registry: new requests for it get 404, while the
requests already accepted (running or waiting) finish with the adapter they were given,
as vLLM's do (each carries its adapter's path; service.engine.adapters frees its slot once
none uses it).
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Blueprint, Response

from service.api.app_state import AppState
from service.api.errors import APIError, bad_request
from service.api.routes_admin import require_admin
from service.api.routes_openai import read_json_body
from service.engine.adapters import AdapterError, AdapterRegistry

blueprint = Blueprint("lora", __name__)


@blueprint.post("/v1/load_lora_adapter")
async def load_lora_adapter() -> Response:
    state = require_admin()
    registry = lora_registry(state)
    body = await read_json_body()
    name, path = text_field(body, "lora_name"), text_field(body, "lora_path")
    if name == state.served_model_name or registry.get(name) is not None:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    try:  # reads a header of the adapter's files: off the event loop
        await trio.to_thread.run_sync(registry.register, name, path)
    except AdapterError as exc:
        raise bad_request(str(exc), exc.field, "invalid_adapter") from None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", 200)


@blueprint.post("/v1/unload_lora_adapter")
async def unload_lora_adapter() -> Response:
    state = require_admin()
    name = text_field(await read_json_body(), "lora_name")
    if not lora_registry(state).unregister(name):
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", 200)


def lora_registry(state: AppState) -> AdapterRegistry:
    if state.adapters is None:
        raise bad_request(
            "LoRA adapters are not enabled on this server (start it with --enable-lora)",
            None,
            "lora_not_enabled",
        )
    return state.adapters


def text_field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{name}' must be a non-empty string", name)
    return value
