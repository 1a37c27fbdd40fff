"""Incremental detokenization with stop strings, one instance per request.

Text is decoded the way vLLM does it: decode a short window of ids ending at the newest
token (from `prefix_offset`) and subtract the decoding of the same window without the new
tokens (up to `read_offset`); the difference is the new text. Decoding in a window keeps
the cost constant per token and lets tokenizers that merge spaces across tokens (SentencePiece,
byte-level BPE) produce the right characters. Text ending in U+FFFD is an incomplete UTF-8
character: it is held back until the following token completes it.

Stop strings: text that could still turn out to be the start of a stop string is held back;
once a stop string appears, it and everything after it are cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# vLLM starts the window this many tokens into the prompt's tail for context
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class Delta:
    text: str  # new text to emit now (may be "")
    stopped: bool  # a stop string was found; the sequence must finish


class Detokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = [s for s in stop if s]
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._text = ""  # decoded output so far
        self._emitted = 0  # how much of _text has been sent

    @property
    def text(self) -> str:
        return self._text[: self._emitted]

    def add_token(self, token_id: int) -> Delta:
        self._ids.append(token_id)
        self._text += self._decode_new()
        return self._release()

    def flush(self) -> str:
        """At the end of a sequence: everything held back (not cut by a stop) goes out."""
        ids = self._ids[self._prefix_offset :]
        prefix = self._tokenizer.decode(ids[: self._read_offset - self._prefix_offset])
        rest = self._tokenizer.decode(ids)[len(prefix) :]
        self._text += rest.rstrip(_INCOMPLETE)
        self._read_offset = len(self._ids)
        out = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out

    def _decode_new(self) -> str:
        window = self._ids[self._prefix_offset :]
        decode = self._tokenizer.decode
        prefix_text = decode(window[: self._read_offset - self._prefix_offset])
        full_text = decode(window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _release(self) -> Delta:
        text = self._text
        if not self._stops:
            out = text[self._emitted :]
            self._emitted = len(text)
            return Delta(out, False)
        # a stop string may straddle the previous release point
        search_from = max(0, self._emitted - self._longest_stop + 1)
        cut = min((i for s in self._stops if (i := text.find(s, search_from)) >= 0), default=-1)
        if cut >= 0:
            out = text[self._emitted : cut]
            self._text = text[:cut]
            self._emitted = cut
            return Delta(out, True)
        safe = len(text) - self._held_back(text)
        out = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return Delta(out, False)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        for n in range(min(self._longest_stop - 1, len(text)), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0
