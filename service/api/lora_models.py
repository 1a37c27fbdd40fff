"""Which model a request names: the base (the served name) or a LoRA adapter, what an
API key may name, and the adapters' /v1/models entries."""

from __future__ import annotations

from typing import Any

from service.api.access import request_key
from service.api.app_state import AppState
from service.api.errors import APIError
from service.engine.adapters import Adapter
from service.engine.request import SamplingParams


def adapter_of(model: str | None, state: AppState) -> Adapter | None:
    """The adapter a request's `model` names (None: the base model); 404 for a name this
    server does not serve, 403 for an adapter the request's API key may not use."""
    if model is None or model == state.served_model_name:
        return None
    adapter = None if state.adapters is None else state.adapters.get(model)
    if adapter is None:
        served = [state.served_model_name, *(state.adapters.names if state.adapters else [])]
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves "
            + ", ".join(f"`{name}`" for name in served)
            + ".",
            param="model",
            code="model_not_found",
        )
    key = request_key()
    if key is not None and key.adapters is not None and adapter.name not in key.adapters:
        raise APIError(
            403,
            f"this API key may not use the adapter `{adapter.name}`",
            param="model",
            code="adapter_not_allowed",
        )
    return adapter


def with_adapter(params: SamplingParams, adapter: Adapter | None) -> None:
    if adapter is not None:
        params.adapter, params.adapter_path = adapter.name, adapter.path


def adapter_cards(state: AppState) -> list[dict[str, Any]]:
    """/v1/models' entries of the adapters, vLLM's shape: `root` the path, `parent` the base."""
    if state.adapters is None:
        return []
    return [
        {
            "id": adapter.name,
            "object": "model",
            "created": 0,
            "owned_by": "cadence",
            "root": adapter.path,
            "parent": state.served_model_name,
        }
        for adapter in map(state.adapters.by_name.__getitem__, state.adapters.names)
    ]
