"""Incremental detokenization with stop strings, one instance per request.

Text is decoded the way vLLM does it: decode a short window of ids ending at the newest
token (from `prefix_offset`) and subtract the decoding of the same window without the new
tokens (up to `read_offset`); the difference is the new text. Decoding in a window keeps
the cost constant per token and lets tokenizers that merge spaces across tokens (SentencePiece,
byte-level BPE) produce the right characters. Text ending in U+FFFD is an incomplete UTF-8
character: it is held back until the following token completes it.

Stop strings: text that could still turn out to be the start of a stop string is held back;
once a stop string appears, it and everything after it are cut. The matcher sees each new
piece of text once and remembers, per stop string, only how much of it the text ends with,
so the work per token does not grow with the output (stop strings are at most
validation.MAX_STOP_CHARS long).
"""

from __future__ import annotations

import io
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
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # as vLLM: a stop string that ends within the first min_tokens tokens' text does not
        # stop the sequence (one that ends in a later token's text may begin there)
        self._unchecked_tokens = min_tokens
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._matcher = StopMatcher([s for s in stop if s])
        self._held = ""  # decoded, not sent: it may be the start of a stop string
        self._sent = io.StringIO()  # appends in place, where `str +=` would copy the output

    @property
    def text(self) -> str:
        return self._sent.getvalue()

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._matcher.found

    def add_token(self, token_id: int) -> Delta:
        self._ids.append(token_id)
        checked = self._unchecked_tokens <= 0
        self._unchecked_tokens -= 1
        return self._release(self._decode_new(), checked)

    def flush(self) -> str:
        """At the end of a sequence: everything held back (not cut by a stop) goes out."""
        ids = self._ids[self._prefix_offset :]
        prefix = self._decode(ids[: self._read_offset - self._prefix_offset])
        rest = self._decode(ids)[len(prefix) :]
        self._read_offset = len(self._ids)
        out = self._held + rest.rstrip(_INCOMPLETE)
        self._held = ""
        self._sent.write(out)
        return out

    def _decode_new(self) -> str:
        window = self._ids[self._prefix_offset :]
        decode = self._decode
        prefix_text = decode(window[: self._read_offset - self._prefix_offset])
        full_text = decode(window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _release(self, new: str, checked: bool) -> Delta:
        pending = self._held + new
        stop_starts_back = self._matcher.feed(new, report=checked)
        if stop_starts_back is not None:
            self._held = ""
            return self._send(pending[: len(pending) - stop_starts_back], stopped=True)
        safe = len(pending) - self._matcher.held
        self._held = pending[safe:]
        return self._send(pending[:safe], stopped=False)

    def _send(self, text: str, stopped: bool) -> Delta:
        self._sent.write(text)
        return Delta(text, stopped)


class StopMatcher:
    """Finds the earliest stop string in text fed piece by piece (Knuth-Morris-Pratt, one
    automaton per stop string). Of the text it keeps, per stop string, only how many
    characters of that stop the text ends with, so a piece costs O(len(piece) + longest
    stop) comparisons per stop string, however long the text before it."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._fallbacks = [_fallback_table(s) for s in stops]
        self._matched = [0] * len(stops)
        self.found: str | None = None  # the earliest stop string found

    @property
    def held(self) -> int:
        """Length of the longest end of the text that begins a stop string (and is not one)."""
        return max(self._matched, default=0)

    def feed(self, piece: str, *, report: bool = True) -> int | None:
        """Add `piece` to the text; if stop strings now appear, how many characters before
        the end of the text the earliest of them starts, else None. With `report` false,
        the stops that end in `piece` are passed over (None), as if it held none."""
        earliest = None
        for i, stop in enumerate(self._stops):
            matched = self._matched[i]
            if not matched and stop[0] not in piece:
                continue  # the common case, checked at C speed
            matched, end = _advance(stop, self._fallbacks[i], matched, piece, report)
            self._matched[i] = matched
            if end >= 0:  # the farthest back from the end is the earliest in the text
                starts_back = len(piece) - end + len(stop)
                if earliest is None or starts_back > earliest:
                    earliest, self.found = starts_back, stop
        return earliest


def _fallback_table(stop: str) -> list[int]:
    """table[n - 1] is the longest proper prefix of stop[:n] that is also a suffix of it:
    where a partial match of n characters resumes when the next character does not fit."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


def _advance(
    stop: str, table: list[int], matched: int, piece: str, report: bool = True
) -> tuple[int, int]:
    """Run one stop string's automaton over `piece`: the characters of `stop` matched at the
    end, and where in `piece` its first complete match ends (-1 if none, or if not
    `report`: then a complete match resumes as a partial one and the run goes on)."""
    for end, char in enumerate(piece, 1):
        while matched and stop[matched] != char:
            matched = table[matched - 1]
        if stop[matched] == char:
            matched += 1
            if matched == len(stop):
                if report:
                    return matched, end
                matched = table[matched - 1]
    return matched, -1
