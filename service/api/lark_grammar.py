"""Lark grammars as xgrammar's EBNF, as vLLM converts them for its xgrammar backend: a
grammar with no `::=` is Lark's (`rule: body`, `| alternatives` on the next lines, `'x'`
strings, `?rule` and `-> alias` marks); its `start` rule, or else its first, is the root.

Beyond vLLM's conversion, Lark's `[item]` (optional) becomes `(item)?` and a `/regex/`
terminal its character classes and quantifiers, which xgrammar's EBNF shares with regular
expressions: read literally, `[item]` would be a character class and match other text.
Directives (`%import`, `%ignore`) have no EBNF form and are refused.
"""

from __future__ import annotations

import re

_COMMENT = re.compile(r"(#|//).*$")
_RULE = re.compile(r"^\??([A-Za-z_][\w]*)(?:\.\d+)?\s*:(?!:)\s*(.*)$")
# a double- or single-quoted string (Lark's "x"i flag is not kept: EBNF has none), or a
# regex, or any other character
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"i?|\'(?:[^\'\\]|\\.)*\'i?|/(?:[^/\\]|\\.)+/[imsx]*|.', re.S)


class LarkError(ValueError):
    """A Lark grammar with what EBNF cannot say."""


def is_lark(grammar: str) -> bool:
    """vLLM's test: no line (comments aside) defines a rule with `::=`."""
    return not any("::=" in _COMMENT.sub("", line) for line in grammar.splitlines())


def lark_to_ebnf(grammar: str) -> str:
    rules: list[tuple[str, str]] = []
    for number, raw in enumerate(grammar.splitlines(), 1):
        line = _COMMENT.sub("", raw).strip()
        if not line:
            continue
        if line.startswith("%"):
            raise LarkError(f"line {number}: Lark's {line.split()[0]} has no EBNF form")
        if line.startswith("|"):
            if not rules:
                raise LarkError(f"line {number}: an alternative before any rule")
            name, body = rules[-1]
            rules[-1] = (name, f"{body} | {_body(line[1:])}")
            continue
        rule = _RULE.match(line)
        if rule is None:
            raise LarkError(f"line {number}: not a rule (`name: ...`): {line[:60]!r}")
        rules.append((rule.group(1), _body(rule.group(2))))
    if not rules:
        raise LarkError("the grammar defines no rule")
    names = {name for name, _ in rules}
    root = "start" if "start" in names else rules[0][0]
    lines = [] if "root" in names else [f"root ::= {root}"]
    return "\n".join(lines + [f"{name} ::= {body}" for name, body in rules])


def _body(text: str) -> str:
    """A rule's right-hand side in EBNF."""
    text = re.sub(r"->\s*\w+", "", text)  # tree aliases name nothing in the language
    out: list[str] = []
    for token in _TOKEN.findall(text):
        if token.startswith("'"):
            out.append('"' + token.rstrip("i")[1:-1].replace('"', '\\"') + '"')
        elif token.startswith('"'):
            out.append(token.rstrip("i"))
        elif token.startswith("/") and len(token) > 1:
            out.append("(" + token[1 : token.rindex("/")] + ")")
        elif token == "[":
            out.append("(")
        elif token == "]":
            out.append(")?")
        else:
            out.append(token)
    return "".join(out).strip()
