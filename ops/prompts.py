"""Prompts of real English text cut to an exact token length with the model's tokenizer.

Every prompt is a window of the shipped corpus (read cyclically) starting at its own token
offset, so no two prompts of a run share a prefix and prefix caching cannot flatter a server.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Protocol

from ops.corpus import full_text

MAX_FIT_ROUNDS = 8  # re-encoding a decoded window shifts its length by a token or two at most
MAX_OFFSET_TRIES = 32


class PromptError(ValueError):
    """A prompt of the requested length cannot be built (bad length or tokenizer)."""


class TokenCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class _HFTokenizersCodec:
    """Adapter over a `tokenizers.Tokenizer` (a tokenizer.json file)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def codec_from_tokenizer_json(path: Path) -> TokenCodec:
    from tokenizers import Tokenizer

    try:
        return _HFTokenizersCodec(Tokenizer.from_file(str(path)))
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise PromptError(f"cannot read tokenizer {path}: {exc}") from exc


def load_codec(source: str | None) -> TokenCodec:
    """The tokenizer prompts are measured with.

    `source`: a tokenizer.json file, a Hugging Face model directory, a .gguf file, or None
    for cadence's default model (fetched and converted once by cadence's model files code).
    """
    if source is not None:
        path = Path(source).expanduser()
        if path.is_file() and path.suffix == ".json":
            return codec_from_tokenizer_json(path)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return codec_from_tokenizer_json(path / "tokenizer.json")
        if not path.exists():
            raise PromptError(f"tokenizer source {source!r} does not exist")
    from service.config import default_cache_dir
    from service.model_files.resolve import resolve_model

    model_dir = resolve_model(source, default_cache_dir())
    return codec_from_tokenizer_json(model_dir / "tokenizer.json")


class PromptMaker:
    """Cuts windows of exactly N tokens out of the corpus."""

    def __init__(self, codec: TokenCodec, text: str | None = None) -> None:
        self._codec = codec
        self._ids = codec.encode((text or full_text()) + "\n\n")
        if len(self._ids) < 2:
            raise PromptError("the corpus encodes to fewer than 2 tokens")

    @property
    def corpus_tokens(self) -> int:
        return len(self._ids)

    def distinct_offsets(self, rng: random.Random, count: int) -> list[int]:
        """`count` start offsets, all different while the corpus has enough tokens."""
        n = len(self._ids)
        if count <= n:
            return rng.sample(range(n), count)
        return [rng.randrange(n) for _ in range(count)]

    def make(self, length: int, offset: int) -> str:
        """Text that the tokenizer encodes to exactly `length` tokens, starting near `offset`."""
        if length < 1:
            raise PromptError(f"prompt length must be >= 1, got {length}")
        for attempt in range(MAX_OFFSET_TRIES):
            text = self._fit(length, offset + attempt)
            if text is not None:
                return text
        raise PromptError(f"no window of the corpus re-encodes to exactly {length} tokens")

    def _window(self, start: int, count: int) -> list[int]:
        n = len(self._ids)
        return [self._ids[(start + i) % n] for i in range(count)]

    def _fit(self, length: int, start: int) -> str | None:
        take = length
        for _ in range(MAX_FIT_ROUNDS):
            text = self._codec.decode(self._window(start, take))
            got = len(self._codec.encode(text))
            if got == length:
                return text
            take += length - got
            if take < 1:
                return None
        return None
