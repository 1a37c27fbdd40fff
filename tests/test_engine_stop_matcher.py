"""The stop-string matcher against a plain reference, exhaustively over a two-letter
alphabet, where stop strings overlap themselves ("aab" in "aaab", "abab" in "abaabab") and a
partial match must fall back to a shorter one instead of starting over."""

from __future__ import annotations

import itertools

from service.engine.detokenizer import StopMatcher, _fallback_table


def words(max_len: int) -> list[str]:
    return ["".join(w) for n in range(1, max_len + 1) for w in itertools.product("ab", repeat=n)]


STOPS = words(4)
TEXTS = words(8)


def held_reference(text: str, stops: list[str]) -> int:
    """The longest end of `text` that begins some stop string without being one."""
    return max(
        (n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
        default=0,
    )


def test_one_character_at_a_time_finds_each_stop_where_it_first_ends():
    for stop in STOPS:
        for text in TEXTS:
            matcher = StopMatcher([stop])
            first = text.find(stop)
            for end in range(1, len(text) + 1):
                starts_back = matcher.feed(text[end - 1])
                if first >= 0 and end == first + len(stop):
                    assert starts_back == len(stop), (stop, text)
                    break
                assert starts_back is None, (stop, text, end)
                assert matcher.held == held_reference(text[:end], [stop]), (stop, text, end)


def test_pieces_of_any_size_report_the_earliest_stop_and_its_start():
    for stops in itertools.combinations(words(3), 2):
        for text in words(7):
            for cut in range(1, len(text)):
                pieces = [text[:cut], text[cut:]]
                matcher = StopMatcher(list(stops))
                seen = ""
                for piece in pieces:
                    seen += piece
                    starts_back = matcher.feed(piece)
                    found = [i for s in stops if (i := seen.find(s)) >= 0]
                    if found:
                        assert starts_back == len(seen) - min(found), (stops, pieces)
                        # the stop it names is one that starts there (vLLM's stop_reason)
                        assert matcher.found in stops
                        assert seen.find(matcher.found) == min(found), (stops, pieces)
                        break
                    assert starts_back is None
                    assert matcher.held == held_reference(seen, list(stops))


def borders_reference(stop: str) -> list[int]:
    """For each prefix of `stop`, its longest proper prefix that is also its suffix."""
    return [
        max((k for k in range(n) if stop[:n].endswith(stop[:k])), default=0)
        for n in range(1, len(stop) + 1)
    ]


def test_the_fallback_table_is_the_longest_border_of_each_prefix():
    for stop in words(9):
        assert _fallback_table(stop) == borders_reference(stop), stop
