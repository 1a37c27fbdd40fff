"""Reading a GGUF file's metadata: the error every GGUF step raises, and typed look-ups."""

from __future__ import annotations

from typing import Any


class GGUFError(ValueError):
    """The file is not a GGUF this converter can turn into a Hugging Face directory."""


def require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"GGUF metadata lacks {key!r}")
    return meta[key]
