"""Lark grammars (vLLM's guided_grammar accepts them) converted to xgrammar's EBNF: the
language stays the same, `[item]` stays optional (not a character class), regex terminals
keep their classes, and what EBNF cannot say is a 400 naming the field."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from service.api.errors import APIError
from service.api.lark_grammar import is_lark, lark_to_ebnf
from service.api.openai_grammar import GUIDED, _constraint

ARITHMETIC = r"""
// a sum of numbers, with an optional fraction
?start: sum
sum: number ((" + " | ' - ') number)*
   | "(" sum ")"  -> group
number: DIGITS ["." DIGITS]
DIGITS: /[0-9]+/
"""


def language(grammar: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(lark_to_ebnf(grammar))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12", True),
        ("1.5 + 20 - 3", True),
        ("(4 + 2)", True),
        ("1.", False),  # the fraction needs digits
        ("1 * 2", False),
        (".", False),  # read as a character class, [\".\" DIGITS] would take it
        ("d", False),
    ],
)
def test_a_lark_grammar_keeps_its_language(text: str, expected: bool) -> None:
    assert accepts(language(ARITHMETIC), text) is expected


def test_only_grammars_without_ebnf_rules_are_lark() -> None:
    assert is_lark(ARITHMETIC)
    assert not is_lark('root ::= "a" // Lark-looking: b: c')
    assert lark_to_ebnf("greeting: 'hi'").splitlines()[0] == "root ::= greeting"


@pytest.mark.parametrize(
    "grammar",
    ["%import common.NUMBER\nstart: NUMBER", "| 'x'", "start 'x'", "// nothing\n"],
)
def test_what_ebnf_cannot_say_is_a_400_naming_the_field(grammar: str) -> None:
    with pytest.raises(APIError) as refused:
        _constraint(GUIDED["guided_grammar"], grammar, "guided_grammar")
    assert refused.value.status == 400 and refused.value.param == "guided_grammar"
