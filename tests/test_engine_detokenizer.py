"""Incremental detokenization: multi-byte characters held back, stop strings cut.

Most cases use the simulated one-byte-per-token tokenizer, which makes every boundary
explicit; the `real_model` ones use the default model's own tokenizer, whose tokens hold
several characters, so stop strings start and end inside tokens.
"""

from __future__ import annotations

import sys
from types import FrameType

import pytest

from service.config import default_cache_dir
from service.engine import detokenizer as detokenizer_module
from service.engine.detokenizer import Detokenizer
from service.engine.validation import MAX_STOP_CHARS
from service.model_files.resolve import resolve_model
from service.tokenizer import Tokenizer
from tests.sim_worker import SimTokenizer

TOK = SimTokenizer()


def feed(detok: Detokenizer, ids: list[int]) -> tuple[list[str], bool]:
    pieces = []
    for i in ids:
        delta = detok.add_token(i)
        pieces.append(delta.text)
        if delta.stopped:
            return pieces, True
    return pieces, False


def test_incomplete_utf8_is_held_until_complete():
    text = "héllo €uro 🎉!"
    detok = Detokenizer(TOK, TOK.encode("prompt "), [])
    pieces, _ = feed(detok, TOK.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    start = len(TOK.encode("héllo "))
    assert pieces[start : start + 3] == ["", "", "€"]


def test_stop_string_cut_with_what_follows_and_prefix_held_back():
    detok = Detokenizer(TOK, [], ["STOP"])
    pieces, stopped = feed(detok, TOK.encode("abc STxSTOP and more"))
    assert stopped
    assert "".join(pieces) == "abc STx"
    assert pieces[4] == "" and pieces[5] == ""  # "S", "ST" could begin the stop string


def test_stop_string_across_tokens_and_flush_at_the_end():
    detok = Detokenizer(TOK, [], ["END", "xy"])
    pieces, stopped = feed(detok, TOK.encode("hello EN"))
    assert not stopped
    assert "".join(pieces) == "hello "
    assert detok.flush() == "EN"  # finished for another reason: held text goes out
    assert detok.text == "hello EN"


def test_earliest_of_several_stop_strings_wins():
    detok = Detokenizer(TOK, [], ["cd", "b"])
    pieces, stopped = feed(detok, TOK.encode("abcd"))
    assert stopped and "".join(pieces) == "a"


def test_earliest_stop_wins_when_two_complete_with_the_same_token():
    # "xab" is held back (it begins "xabc"); the next token completes both stop strings
    detok = Detokenizer(TOK, [], ["bc", "xabc"])
    pieces, stopped = feed(detok, TOK.encode("xabcd"))
    assert stopped and pieces == ["", "", "", ""] and detok.text == ""


def test_stop_string_at_the_very_start_of_the_output():
    detok = Detokenizer(TOK, TOK.encode("prompt "), ["Hi"])
    pieces, stopped = feed(detok, TOK.encode("Hi there"))
    assert stopped and pieces == ["", ""] and detok.text == ""


def test_stop_string_straddling_the_last_release_point():
    detok = Detokenizer(TOK, [], ["cde"])
    pieces, stopped = feed(detok, TOK.encode("abcdef"))
    assert stopped and pieces == ["a", "b", "", "", ""] and detok.text == "ab"


def test_no_stop_strings_streams_everything():
    detok = Detokenizer(TOK, TOK.encode("x"), [])
    pieces, _ = feed(detok, TOK.encode("plain text"))
    assert pieces == list("plain text")


@pytest.fixture(scope="module")
def real_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(None, default_cache_dir()))


def feed_text(tokenizer: Tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool]:
    detok = Detokenizer(tokenizer, tokenizer.encode("Say it:"), stop)
    return feed(detok, tokenizer.encode(text))


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("stop", "expected_text", "tokens_fed"),
    [
        ([" Paris"], "", 1),  # the very first token is the stop string
        ([" Par"], "", 1),  # the stop string ends inside the first token
        (["aris is"], " P", 2),  # starts inside one token, ends inside the next
        (["France", " is"], " Paris", 2),  # the earliest of several wins
        (["capital of"], " Paris is the ", 5),
        (["nowhere"], " Paris is the capital of France.", 7),
    ],
)
def test_stop_strings_with_the_real_tokenizer(real_tokenizer, stop, expected_text, tokens_fed):
    pieces, stopped = feed_text(real_tokenizer, " Paris is the capital of France.", stop)
    assert len(pieces) == tokens_fed
    assert stopped == (stop != ["nowhere"])
    assert "".join(pieces) == expected_text


@pytest.mark.real_model
def test_multibyte_characters_split_across_real_tokens_are_held_whole(real_tokenizer):
    text = " The café costs 5€ 🎉 today."
    pieces, stopped = feed_text(real_tokenizer, text, [])
    assert not stopped and "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert " 🎉" in pieces  # released whole, by the third of its three tokens


# ---- the cost of stop strings ---------------------------------------------------------------


class LinesRun:
    """Counts the Python lines run in one module's code. The stop-string matcher's loops are
    Python, so this counts its comparisons; its C-level string operations only touch the new
    text and the held-back window (at most MAX_STOP_CHARS - 1 characters)."""

    def __init__(self, module_file: str) -> None:
        self.count = 0
        self._file = module_file

    def __enter__(self) -> LinesRun:
        self._previous = sys.gettrace()
        sys.settrace(self._enter_frame)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._previous)

    def _enter_frame(self, frame: FrameType, event: str, arg: object):
        return self._count_line if frame.f_code.co_filename == self._file else None

    def _count_line(self, frame: FrameType, event: str, arg: object):
        self.count += event == "line"
        return self._count_line


def test_the_work_per_token_does_not_grow_with_the_output():
    # The 16 longest stop strings allowed, each starting with a phrase the output keeps
    # repeating (so every token advances their matching) and then going elsewhere.
    phrase = "Tell me more about the quick brown fox and the dog"  # 50 characters
    stops = [(phrase[i : i + 10 + i] + "~" * MAX_STOP_CHARS)[:MAX_STOP_CHARS] for i in range(16)]
    detok = Detokenizer(TOK, TOK.encode("Say it:"), stops)
    ids = TOK.encode(phrase * 100)
    lines_per_window = []
    held_back = False
    for start in range(0, 5000, 100):  # windows of 100 tokens: two repetitions of the phrase
        with LinesRun(detokenizer_module.__file__) as lines:
            deltas = [detok.add_token(i) for i in ids[start : start + 100]]
        lines_per_window.append(lines.count)
        held_back |= any(d.text == "" for d in deltas)
        assert not any(d.stopped for d in deltas)
    assert held_back  # the stop strings were live: text that began one was held
    near_start, at_the_end = lines_per_window[1], lines_per_window[-1]
    assert at_the_end <= near_start


def vllm_stop_with_min_tokens(text_of_tokens: list[str], stop: str, min_tokens: int) -> int | None:
    """vLLM's rule, stated directly: after each token past the first min_tokens, a stop
    string that ends in that token's text (it may begin before) stops the output there;
    the length of the output kept, or None."""
    text = ""
    for count, piece in enumerate(text_of_tokens, 1):
        before, text = len(text), text + piece
        if count <= min_tokens:
            continue
        found = text.find(stop, max(0, before - len(stop) + 1))
        if found != -1:
            return found
    return None


@pytest.mark.parametrize("min_tokens", [0, 2, 5, 6, 9, 12, 30])
def test_a_stop_string_ending_within_min_tokens_does_not_stop_as_in_vllm(min_tokens):
    text = "aSTOPbcSTOPdefSTSTOPg"  # one byte a token: stops end at tokens 5, 11, 20
    detok = Detokenizer(TOK, [], ["STOP"], min_tokens=min_tokens)
    pieces, stopped = feed(detok, TOK.encode(text))
    expected = vllm_stop_with_min_tokens(list(text), "STOP", min_tokens)
    assert stopped == (expected is not None)
    kept = "".join(pieces) + ("" if stopped else detok.flush())
    assert kept == (text if expected is None else text[:expected])
