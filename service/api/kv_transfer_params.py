"""The request field of vLLM's prefill/decode handover, `kv_transfer_params`, read into the
engine's SamplingParams fields: a prefill server's `do_remote_decode`, or a decode server's
`do_remote_prefill` with what the producer answered (service.engine.kv_transfer). Whether
this server takes part (--kv-transfer-role) is the engine's check."""

from __future__ import annotations

from typing import Any

from gpu_worker.protocol import RemoteRank
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
    return RemoteKv(
        transfer_id=_typed(value, "transfer_id", str),
        engine_id=_typed(value, "remote_engine_id", str),
        host=_typed(value, "remote_host", str),
        port=_typed(value, "remote_port", int),
        block_ids=_per_group(value, "remote_block_ids"),
        tensors=_ints(value, "remote_tensors"),
        num_blocks=_typed(value, "remote_num_blocks", int),
        prompt_tokens=_typed(value, "prompt_tokens", int),
        fingerprint=_typed(value, "fingerprint", dict),
        staging_address=_address(value, "remote_staging_address"),
        hold_seconds=_seconds(value, "remote_hold_seconds"),
        ranks=_remote_ranks(value.get("remote_ranks", [])),
    )


def _remote_ranks(value: Any) -> list[RemoteRank]:
    """A tensor-parallel producer's ranks (its answer's remote_ranks): where each serves
    its shard; whether they are as many as this server's is the engine's check."""
    where = "remote_ranks"
    if not isinstance(value, list) or not all(isinstance(rank, dict) for rank in value):
        raise bad_request(f"'{PARAM}.{where}' must be a list of objects", PARAM)
    return [
        RemoteRank(
            f"{_typed(rank, 'remote_host', str, where)}:{_typed(rank, 'remote_port', int, where)}",
            _ints(rank, "remote_tensors", where),
            _address(rank, "remote_staging_address", where),
        )
        for rank in value
    ]


def _typed(value: dict[str, Any], name: str, kind: type, within: str = "") -> Any:
    found = value.get(name)
    if not isinstance(found, kind) or isinstance(found, bool):
        raise bad_request(
            f"'{_path(name, within)}' must be a {kind.__name__} (as the producer answered it)",
            PARAM,
        )
    return found


def _ints(value: dict[str, Any], name: str, within: str = "") -> list[int]:
    return _checked_ints(_typed(value, name, list, within), name, within)


def _checked_ints(found: Any, name: str, within: str = "") -> list[int]:
    if not isinstance(found, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in found
    ):
        raise bad_request(f"'{_path(name, within)}' must be a list of non-negative integers", PARAM)
    return found


def _per_group(value: dict[str, Any], name: str) -> list[list[int]]:
    """A hybrid model's block ids: a list per KV group; one group's: one flat list."""
    found = _typed(value, name, list)
    if found and all(isinstance(ids, list) for ids in found):
        return [_checked_ints(ids, name) for ids in found]
    return [_checked_ints(found, name)]


def _address(value: dict[str, Any], name: str, within: str = "") -> int | None:
    """Null or absent (the producer staged nothing), or a non-negative integer."""
    if value.get(name) is None:
        return None
    found = _typed(value, name, int, within)
    if found < 0:
        raise bad_request(f"'{_path(name, within)}' must be a non-negative integer or null", PARAM)
    return found


def _seconds(value: dict[str, Any], name: str) -> float | None:
    """Null or absent (a producer that does not say), or a non-negative number."""
    found = value.get(name)
    if found is None:
        return None
    if isinstance(found, bool) or not isinstance(found, int | float) or found < 0:
        raise bad_request(f"'{PARAM}.{name}' must be a non-negative number or null", PARAM)
    return float(found)


def _path(name: str, within: str) -> str:
    """A field's name in an error: kv_transfer_params.name, or .within[].name."""
    return f"{PARAM}.{within}[].{name}" if within else f"{PARAM}.{name}"
