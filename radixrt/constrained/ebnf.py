r"""EBNF grammars (SGLang's ``ebnf`` sampling field, GBNF / xgrammar notation) turned into one regex.

    root ::= "The answer is " answer "."
    answer ::= "yes" | "no" | [0-9]+ ("." [0-9]{1,2})?

A grammar is rules ``name ::= expression`` (a rule ends where the next ``name ::=`` begins); expressions are
string literals in double quotes (escapes ``\n \t \r \\ \" \xHH \uHHHH``), character classes (``[a-z_]``,
``[^"\n]``), ``.`` (any character), rule names, groups ``( )``, alternatives ``|``, sequences, and the
quantifiers ``* + ?`` and ``{m}`` / ``{m,}`` / ``{m,n}``; ``#`` starts a comment. Generation starts at ``root``.

radixrt's constrained decoding runs on regular expressions (outlines-core), so rules are inlined into the root:
a grammar whose rules refer to themselves, directly or through others (nested brackets of any depth), is refused
with a ``ValueError`` naming the cycle, as is a rule used but not defined, a grammar without ``root``, and a
syntax error (with its line and column). The regex uses the grammar engine's syntax (a subset of Python's).
Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from radixrt.constrained.patterns import escape
from radixrt.constrained.text_regex import ANY, END, class_char

MAX_REGEX_CHARS = 200_000  # a grammar that inlines into more is refused (the DFA would take too long to build)

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\n]+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_-]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<charclass>\[(?:[^\]\\]|\\.)*\])
  | (?P<repeat>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[|()*+?.])
""", re.VERBOSE)


@dataclass
class Token:
    kind: str
    text: str
    pos: int


def _tokens(source: str) -> list[Token]:
    out: list[Token] = []
    pos = 0
    while pos < len(source):
        match = _TOKEN.match(source, pos)
        if match is None:
            raise ValueError(f"invalid EBNF at {_where(source, pos)}: unexpected {source[pos]!r}")
        if match.lastgroup != "space":
            out.append(Token(match.lastgroup, match.group(), pos))
        pos = match.end()
    return out


def _where(source: str, pos: int) -> str:
    line = source.count("\n", 0, pos) + 1
    return f"line {line}, column {pos - (source.rfind(chr(10), 0, pos) + 1) + 1}"


def _unescape(body: str, source: str, pos: int) -> list[str]:
    """The characters of a literal's or class's body, escapes decoded (each escaped char kept as one)."""
    out, i = [], 0
    simple = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "]": "]", "[": "[", "-": "-", "^": "^",
              "/": "/", "'": "'"}
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1] if i + 1 < len(body) else ""
        width = {"x": 2, "u": 4, "U": 8}.get(nxt)
        if width:
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise ValueError(f"invalid EBNF at {_where(source, pos + i)}: bad \\{nxt} escape")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        elif nxt in simple:
            out.append("\\" + simple[nxt] if nxt in "-^]" else simple[nxt])  # kept escaped inside a class
            i += 2
        else:
            raise ValueError(f"invalid EBNF at {_where(source, pos + i)}: unknown escape \\{nxt}")
    return out


def _class_regex(token: Token, source: str) -> str:
    body = token.text[1:-1]
    negate = body.startswith("^")
    if negate:
        body = body[1:]
    chars = _unescape(body, source, token.pos + 1 + negate)
    if not chars and not negate:
        raise ValueError(f"invalid EBNF at {_where(source, token.pos)}: an empty character class")
    parts = []
    i = 0
    while i < len(chars):
        c = chars[i]
        if i + 2 < len(chars) and chars[i + 1] == "-":  # a range a-z (an escaped "\-" is a literal dash)
            lo, hi = _literal_char(c), _literal_char(chars[i + 2])
            if ord(lo) > ord(hi):
                raise ValueError(f"invalid EBNF at {_where(source, token.pos)}: range {lo!r}-{hi!r} is reversed")
            parts.append(class_char(lo) + "-" + class_char(hi))
            i += 3
        else:
            parts.append(class_char(_literal_char(c)))
            i += 1
    if negate:
        parts.append(class_char(END))
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


def _literal_char(c: str) -> str:
    return c[1] if len(c) == 2 and c[0] == "\\" else c


class _Parser:
    """Recursive descent over one rule's tokens; returns regex text, rule names left as ``\x00name\x00``."""

    def __init__(self, tokens: list[Token], source: str):
        self.tokens, self.source, self.i = tokens, source, 0
        self.refs: set[str] = set()

    def _peek(self) -> Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _fail(self, message: str) -> ValueError:
        token = self._peek()
        where = _where(self.source, token.pos) if token else "the end of the rule"
        return ValueError(f"invalid EBNF at {where}: {message}")

    def parse(self) -> str:
        regex = self._alternatives()
        if self._peek() is not None:
            raise self._fail(f"unexpected {self._peek().text!r}")
        return regex

    def _alternatives(self) -> str:
        options = [self._sequence()]
        while (t := self._peek()) is not None and t.text == "|":
            self.i += 1
            options.append(self._sequence())
        return options[0] if len(options) == 1 else "(" + "|".join(options) + ")"

    def _sequence(self) -> str:
        items = []
        while (t := self._peek()) is not None and t.text not in ("|", ")"):
            items.append(self._quantified())
        if not items:
            raise self._fail("an empty alternative")
        return "".join(items)

    def _quantified(self) -> str:
        atom = self._atom()
        while (t := self._peek()) is not None and (t.text in ("*", "+", "?") or t.kind == "repeat"):
            self.i += 1
            if t.kind == "repeat":
                counts = [c.strip() for c in t.text[1:-1].split(",")]
                lo = int(counts[0])
                hi = None if len(counts) == 2 and counts[1] == "" else int(counts[-1])
                if hi is not None and hi < lo:
                    raise ValueError(f"invalid EBNF at {_where(self.source, t.pos)}: {t.text} has max < min")
                atom = f"({atom}){{{lo}}}" if len(counts) == 1 else f"({atom}){{{lo},{'' if hi is None else hi}}}"
            else:
                atom = f"({atom}){t.text}"
        return atom

    def _atom(self) -> str:
        t = self._peek()
        if t is None:
            raise self._fail("an expression is missing")
        self.i += 1
        if t.kind == "string":
            chars = [_literal_char(c) for c in _unescape(t.text[1:-1], self.source, t.pos + 1)]
            return "(" + escape("".join(chars)) + ")" if chars else "()"
        if t.kind == "charclass":
            return _class_regex(t, self.source)
        if t.kind == "name":
            self.refs.add(t.text)
            return "\x00" + t.text + "\x00"
        if t.text == ".":
            return ANY
        if t.text == "(":
            inner = self._alternatives()
            closing = self._peek()
            if closing is None or closing.text != ")":
                raise self._fail("a group is not closed")
            self.i += 1
            return "(" + inner + ")"
        self.i -= 1
        raise self._fail(f"unexpected {t.text!r}")


def ebnf_regex(source: str, root: str = "root") -> str:
    """The regex of the strings ``source``'s ``root`` rule derives; ``ValueError`` naming the problem."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError("the EBNF grammar is empty")
    tokens = _tokens(source)
    starts = [i for i in range(len(tokens) - 1) if tokens[i].kind == "name" and tokens[i + 1].kind == "define"]
    if not starts or starts[0] != 0:
        where = _where(source, tokens[0].pos) if tokens else "line 1, column 1"
        raise ValueError(f"invalid EBNF at {where}: a grammar is rules of the form name ::= expression")
    rules: dict[str, tuple[str, set[str]]] = {}
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(tokens)
        name = tokens[start].text
        if name in rules:
            raise ValueError(f"invalid EBNF at {_where(source, tokens[start].pos)}: rule {name!r} is defined twice")
        body = tokens[start + 2:end]
        if any(t.kind == "define" for t in body):
            raise ValueError(f"invalid EBNF at {_where(source, tokens[start].pos)}: misplaced ::=")
        parser = _Parser(body, source)
        rules[name] = (parser.parse(), parser.refs)
    if root not in rules:
        raise ValueError(f"the EBNF grammar has no {root!r} rule (generation starts there)")
    return _inline(root, rules, [], {})


def _inline(name: str, rules: dict[str, tuple[str, set[str]]], path: list[str], done: dict[str, str]) -> str:
    if name in done:
        return done[name]
    if name in path:
        cycle = " -> ".join(path[path.index(name):] + [name])
        raise ValueError(f"EBNF rule {name!r} is recursive ({cycle}): radixrt compiles grammars to a regular "
                         "expression, which cannot nest without bound; unroll the recursion to a fixed depth")
    if name not in rules:
        raise ValueError(f"EBNF rule {name!r} is used but not defined")
    regex, refs = rules[name]
    for ref in sorted(refs):
        inner = _inline(ref, rules, path + [name], done)
        regex = regex.replace("\x00" + ref + "\x00", "(" + inner + ")")
        if len(regex) > MAX_REGEX_CHARS:
            raise ValueError(f"the EBNF grammar inlines into more than {MAX_REGEX_CHARS} regex characters")
    done[name] = regex
    return regex
