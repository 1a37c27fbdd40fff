"""Incremental detokenization: multi-byte characters held back, stop strings cut."""

from __future__ import annotations

from service.detokenizer import Detokenizer
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


def test_no_stop_strings_streams_everything():
    detok = Detokenizer(TOK, TOK.encode("x"), [])
    pieces, _ = feed(detok, TOK.encode("plain text"))
    assert pieces == list("plain text")
