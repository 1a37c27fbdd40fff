"""The request field of vLLM's prefill/decode handover, `kv_transfer_params`, read into the
engine's SamplingParams fields: a prefill server's `do_remote_decode`, or a decode server's
`do_remote_prefill` with what the producer answered (service.engine.kv_transfer). Whether
this server takes part (--kv-transfer-role) is the engine's check."""

from __future__ import annotations

from typing import Any

from service.api.errors import bad_request
from service.engine.kv_transfer import PARAM, RemoteKv


def kv_transfer_fields(value: Any) -> dict[str, Any]:
    """SamplingParams' remote_decode or remote_kv; {} for null or an object of null and
    false values (a connector's "no handover")."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{PARAM}' must be an object or null", PARAM)
    if value.get("do_remote_decode") is True:
        return {"remote_decode": True}
    if value.get("do_remote_prefill") is True:
        return {"remote_kv": _remote_kv(value)}
    if any(value.values()):  # asks for something, but neither half of a handover
        raise bad_request(
            f"'{PARAM}' must ask for do_remote_decode or do_remote_prefill, or nothing", PARAM
        )
    return {}


def _remote_kv(value: dict[str, Any]) -> RemoteKv:
    def typed(name: str, kind: type) -> Any:
        found = value.get(name)
        if not isinstance(found, kind) or isinstance(found, bool):
            raise bad_request(
                f"'{PARAM}.{name}' must be a {kind.__name__} (as the producer answered it)",
                PARAM,
            )
        return found

    def ints(name: str, found: Any) -> list[int]:
        if not isinstance(found, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in found
        ):
            raise bad_request(f"'{PARAM}.{name}' must be a list of non-negative integers", PARAM)
        return found

    def per_group(name: str) -> list[list[int]]:
        """A hybrid model's block ids: a list per KV group; one group's: one flat list."""
        found = typed(name, list)
        if found and all(isinstance(ids, list) for ids in found):
            return [ints(name, ids) for ids in found]
        return [ints(name, found)]

    return RemoteKv(
        transfer_id=typed("transfer_id", str),
        engine_id=typed("remote_engine_id", str),
        host=typed("remote_host", str),
        port=typed("remote_port", int),
        block_ids=per_group("remote_block_ids"),
        tensors=ints("remote_tensors", typed("remote_tensors", list)),
        num_blocks=typed("remote_num_blocks", int),
        prompt_tokens=typed("prompt_tokens", int),
        fingerprint=typed("fingerprint", dict),
    )
