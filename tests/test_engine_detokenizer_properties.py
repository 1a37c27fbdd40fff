"""Incremental detokenization against a from-scratch oracle, on random token streams.

The detokenizer must emit, token by token, exactly the text that decoding the whole output
at once would give, except that it holds back what could still become a stop string (the
longest suffix that begins one, and no more) and an incomplete UTF-8 character, and cuts
the text at the first stop string to appear. Hypothesis builds outputs from whole-word
tokens and multi-byte characters split into byte tokens, decoded by a SentencePiece-like
tokenizer that drops the leading space of whatever it decodes (so text is only right when
decoded in context), and compares every delta with the oracle.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.engine.detokenizer import Delta, Detokenizer
from tests.sim_worker import SimTokenizer

WORDS: list[str | bytes] = [
    "▁the", "▁cat", "▁sat", "ing", "▁on", "!", "▁a", "b", "c", "ab", "▁", "▁banana",
    b"\xc3\xa9\xe2",  # "é" and the first byte of "€": byte-level BPE merges across characters
    b"\x82\xac",  # the rest of "€"
]  # fmt: skip
WORD_BASE = 1000  # ids >= WORD_BASE are words; ids < 256 are bytes
EOS = 999  # a special token: decodes to nothing (the model may emit it with ignore_eos)
CHARS = ["é", "€", "🎉", "ß", "中"]


def piece(i: int) -> bytes:
    if i == EOS:
        return b""
    if i < WORD_BASE:
        return bytes([i])
    word = WORDS[i - WORD_BASE]
    return word if isinstance(word, bytes) else word.replace("▁", " ").encode()


class PieceTokenizer:
    """Byte tokens, whole-word pieces and a special token; like SentencePiece, "▁" is a space
    and a decoded string never starts with one, so a piece decoded alone may lose its space."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = b"".join(piece(i) for i in ids).decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text


TOK = PieceTokenizer()

segments = st.one_of(
    st.integers(0, len(WORDS) - 3).map(lambda i: [WORD_BASE + i]),
    st.sampled_from(CHARS).map(lambda c: list(c.encode())),
    st.sampled_from("abc xy").map(lambda c: [ord(c)]),
    st.just([EOS]),
    st.just([WORD_BASE + len(WORDS) - 2, WORD_BASE + len(WORDS) - 1]),  # "é€" in two pieces
)


def decoded_prefixes(prompt: list[int], output: list[int]) -> list[str]:
    """The output text a whole-sequence decode gives after each output token; an incomplete
    trailing character is not text yet, so the text stays what it was."""
    prompt_text = TOK.decode(prompt)
    texts, last = [], ""
    for n in range(1, len(output) + 1):
        full = TOK.decode(prompt + output[:n])
        if not full.endswith("\ufffd"):
            last = full[len(prompt_text) :]
        texts.append(last)
    return texts


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that begins a stop string but is not one."""
    return max(
        (n for n in range(1, len(text) + 1) for s in stops if len(s) > n and s[:n] == text[-n:]),
        default=0,
    )


def first_stop(text: str, stops: list[str]) -> int:
    found = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(found, default=-1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(segments, min_size=1, max_size=8).map(lambda s: [i for x in s for i in x]),
    output=st.lists(segments, max_size=20).map(lambda s: [i for x in s for i in x]),
    stops=st.lists(st.text(alphabet="abc xyé!tg", min_size=0, max_size=4), max_size=3),
)
def test_every_delta_matches_the_oracle(prompt: list[int], output: list[int], stops: list[str]):
    detok = Detokenizer(TOK, prompt, stops)
    live = [s for s in stops if s]
    texts = decoded_prefixes(prompt, output)
    emitted = ""
    for n, text in enumerate(texts):
        delta = detok.add_token(output[n])
        assert isinstance(delta, Delta)
        assert "\ufffd" not in delta.text
        cut = first_stop(text, live)
        if cut >= 0:
            assert delta.stopped
            assert emitted + delta.text == text[:cut]
            assert detok.text == text[:cut]
            return
        assert not delta.stopped
        safe = len(text) - held_back(text, live)
        assert emitted + delta.text == text[:safe], "held back too much or too little"
        emitted += delta.text
        assert detok.text == emitted
    # at the end, what is held back goes out; an incomplete character never does
    final = TOK.decode(prompt + output)[len(TOK.decode(prompt)) :].rstrip("\ufffd")
    assert emitted + detok.flush() == final
    assert detok.text == final


# U+FFFD itself is left out: in decoded text it is indistinguishable from an incomplete
# character, which is held back (and dropped if the sequence ends there), as in vLLM.
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), min_size=1, max_size=30)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, prompt=st.text(max_size=10))
def test_without_stop_strings_any_unicode_streams_back_exactly(text: str, prompt: str):
    tok = SimTokenizer()
    detok = Detokenizer(tok, tok.encode(prompt), [])
    pieces = [detok.add_token(i) for i in tok.encode(text)]
    assert not any(p.stopped for p in pieces)
    assert all("\ufffd" not in p.text for p in pieces)
    assert "".join(p.text for p in pieces) + detok.flush() == text
    assert detok.flush() == ""  # nothing twice


# ---- examples at the edges ----------------------------------------------------------------


def feed(detok: Detokenizer, ids: list[int]) -> list[Delta]:
    """Add tokens until a stop string is found (the engine finishes the request there)."""
    deltas = []
    for i in ids:
        deltas.append(detok.add_token(i))
        if deltas[-1].stopped:
            break
    return deltas


def word(piece: str) -> int:
    return WORD_BASE + WORDS.index(piece)


def test_the_first_output_word_keeps_its_space_after_the_prompt():
    detok = Detokenizer(TOK, [word("▁the"), word("▁cat")], [])
    deltas = feed(detok, [word("▁sat"), word("ing"), word("▁on")])
    assert [d.text for d in deltas] == [" sat", "ing", " on"]


def test_the_prompt_context_is_only_its_last_tokens():
    long_prompt = [ord("x")] * 40 + [word("▁the")]
    detok = Detokenizer(TOK, long_prompt, [])
    assert [d.text for d in feed(detok, [word("▁cat")])] == [" cat"]


def test_without_a_prompt_a_leading_space_is_dropped_like_a_whole_decode():
    detok = Detokenizer(TOK, [], [])
    deltas = feed(detok, [word("▁the"), word("▁cat")])
    assert [d.text for d in deltas] == ["the", " cat"]


def test_a_multi_byte_character_comes_out_whole_on_its_last_byte():
    detok = Detokenizer(TOK, [ord("x")], [])
    deltas = feed(detok, list("🎉".encode()))
    assert [d.text for d in deltas] == ["", "", "", "🎉"]


def test_flush_drops_an_incomplete_character_but_keeps_held_text():
    detok = Detokenizer(TOK, [ord("x")], ["abc"])
    deltas = feed(detok, [ord("a"), ord("b"), *list("€".encode())[:2]])
    assert "".join(d.text for d in deltas) == ""
    assert detok.flush() == "ab"
    assert detok.text == "ab"


def test_empty_stop_strings_are_ignored():
    detok = Detokenizer(TOK, [ord("x")], ["", ""])
    deltas = feed(detok, [ord("a"), ord("b")])
    assert [d.text for d in deltas] == ["a", "b"] and not any(d.stopped for d in deltas)


def test_a_stop_string_inside_one_token_cuts_mid_token():
    detok = Detokenizer(TOK, [ord("x")], ["at"])
    deltas = feed(detok, [word("▁the"), word("▁cat"), word("▁on")])
    assert [d.text for d in deltas] == [" the", " c"]
    assert deltas[-1].stopped and detok.text == " the c"


def test_held_text_that_stops_being_a_stop_prefix_is_released_with_the_next_token():
    detok = Detokenizer(TOK, [ord("x")], ["abc"])
    deltas = feed(detok, [ord("a"), ord("b"), ord("x"), ord("a")])
    assert [d.text for d in deltas] == ["", "", "abx", ""]
    assert detok.text == "abx"


def test_a_stop_string_that_completes_before_a_longer_one_wins():
    detok = Detokenizer(TOK, [ord("x")], ["abcd", "bc"])
    deltas = feed(detok, [ord("a"), ord("b"), ord("c"), ord("d")])
    assert len(deltas) == 3 and deltas[2].stopped and detok.text == "a"


def test_a_special_token_mid_stream_does_not_cost_the_next_word_its_space():
    detok = Detokenizer(TOK, [word("▁the")], [])
    deltas = feed(detok, [word("▁cat"), EOS, word("▁sat"), EOS, EOS, word("▁on")])
    assert "".join(d.text for d in deltas) == " cat sat on"


def test_a_character_completed_by_the_next_token_is_released_whole():
    first, second = WORD_BASE + len(WORDS) - 2, WORD_BASE + len(WORDS) - 1
    detok = Detokenizer(TOK, [word("▁the")], [])
    deltas = feed(detok, [word("▁cat"), first, second])
    assert [d.text for d in deltas] == [" cat", "", "é€"]


def test_flush_releases_complete_characters_held_with_an_incomplete_one():
    first = WORD_BASE + len(WORDS) - 2  # "é" plus the first byte of "€"
    detok = Detokenizer(TOK, [word("▁the")], [])
    deltas = feed(detok, [word("▁cat"), first])
    assert [d.text for d in deltas] == [" cat", ""]
    assert detok.flush() == "é"  # the sequence ended here: "é" is whole, "€" never came


def test_the_first_occurrence_of_a_stop_string_in_a_token_is_the_cut():
    detok = Detokenizer(TOK, [word("▁the")], ["an"])
    deltas = feed(detok, [word("▁cat"), word("▁banana")])
    assert deltas[-1].stopped and detok.text == " cat b"
