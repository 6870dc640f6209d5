r"""Regex pieces of the tool-call constraints (outlines-core / Rust regex syntax, also valid for Python's ``re``).

- ``arguments_regex``: a tool's arguments under its JSON schema (radixrt.constrained.patterns), cached.
- ``text_without(marker, before_marker)``: any text that does not contain ``marker``; with ``before_marker``,
  also the text may be followed by the marker without the marker occurring earlier (a text ending in a
  border of the marker would make the marker start sooner). Built mechanically: the marker's KMP automaton
  (radixrt.tools.markers, the parser's own) with the marker's last step removed, turned into a regex by state
  elimination.
- ``text_without_any(markers, before)``: the same for several markers (a reasoning block ends at ``</think>``
  and must not hold ``<tool_call>``), over the markers' prefixes.
- ``not_starting_with(words)``: any text that, after JSON whitespace, does not begin with the first character
  of one of ``words``.
Characters are escaped for both engines: ``<`` and ``>`` stay bare (``\<`` is a word boundary in Rust).
"""

from __future__ import annotations

import json
from functools import lru_cache

from radixrt.constrained.patterns import escape, json_schema_regex
from radixrt.tools.markers import failure_table, next_state
from radixrt.tools.scan import WHITESPACE

# Any character but the grammar's end-of-match one (radixrt.constrained.grammar.end_anchored): free text that
# could also spell the end would make the token index explode.
END = "\uFFFF"
ANY = "[^" + END + "]"
WS_CLASS = "[ \\t\\n\\r]"


def alternation(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


def char_class(chars: set[str], negate: bool = False) -> str:
    if negate:
        chars = chars | {END}
    body = "".join(_class_char(c) for c in sorted(chars))
    if not negate and len(chars) == 1:
        return escape(next(iter(chars)))
    return "[" + ("^" if negate else "") + body + "]"


def _class_char(c: str) -> str:
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c) or ("\\" + c if c in "\\]^-[&~" else c)


@lru_cache(maxsize=256)
def _schema_regex(schema_json: str, json_whitespace: str) -> str:
    return json_schema_regex(json.loads(schema_json), json_whitespace)


def arguments_regex(tool, json_whitespace: str = "") -> str:
    """The JSON text of ``tool``'s arguments under its schema; ValueError when it does not compile."""
    return "(" + _schema_regex(json.dumps(tool.parameters, sort_keys=False), json_whitespace) + ")"


# ---------------------------------------------------------------- text without a marker

def _concat(*parts: str | None) -> str:
    return "".join(p for p in parts if p)


def _alt(a: str | None, b: str) -> str:
    if a is None:
        return b
    if a == "" and b == "":
        return ""
    if a == "":
        return f"({b})?"
    if b == "":
        return f"({a})?"
    return f"({a}|{b})"


def _star(loop: str | None) -> str:
    return f"({loop})*" if loop else ""


def _eliminate(n: int, edges: dict[tuple[int, int], str], finals: list[int]) -> str:
    """Regex of the paths from state 0 to any of ``finals`` of an automaton with states 0..n-1 (labels
    are regexes; "" is the empty word), by state elimination."""
    start, final = n, n + 1
    graph = dict(edges)
    graph[(start, 0)] = ""
    for f in finals:
        graph[(f, final)] = _alt(graph.get((f, final)), "")
    for q in reversed(range(n)):
        loop = graph.pop((q, q), None)
        ins = [(p, label) for (p, r), label in graph.items() if r == q]
        outs = [(r, label) for (p, r), label in graph.items() if p == q]
        for p, _ in ins:
            del graph[(p, q)]
        for r, _ in outs:
            del graph[(q, r)]
        for p, into in ins:
            for r, out in outs:
                graph[(p, r)] = _alt(graph.get((p, r)), _concat(into, _star(loop), out))
    return graph.get((start, final), "")


@lru_cache(maxsize=32)
def text_without(marker: str, before_marker: bool = False) -> str:
    """Regex of the texts without ``marker`` (see the module docstring for ``before_marker``)."""
    if not marker:
        raise ValueError("the marker is empty")
    table = failure_table(marker)
    m = len(marker)
    alphabet = sorted(set(marker))
    edges: dict[tuple[int, int], str] = {}
    for state in range(m):
        by_target: dict[int, set[str]] = {}
        for ch in alphabet:
            target = next_state(marker, table, state, ch)
            if target < m:
                by_target.setdefault(target, set()).add(ch)
        # every other character (also those outside the marker) goes back to state 0
        leaving = set(alphabet) - by_target.pop(0, set())
        labels = {0: char_class(leaving, negate=True) if leaving else ANY}
        labels.update({t: char_class(chars) for t, chars in by_target.items()})
        for target, label in labels.items():
            edges[(state, target)] = label
    if before_marker:
        finals = [s for s in range(m) if _marker_first_ends_at_end(marker, table, s)]
    else:
        finals = list(range(m))
    return "(" + _eliminate(m, edges, finals) + ")"


@lru_cache(maxsize=32)
def text_without_any(markers: tuple[str, ...], before: str | None = None) -> str:
    """Regex of the texts without any of ``markers``; with ``before`` (one of them), texts that ``before`` may
    follow as the first marker to occur. The automaton's states are the markers' proper prefixes: after each
    character, the longest suffix of the text read that is one (a suffix that is a whole marker: no edge)."""
    if not markers or not all(markers) or (before is not None and before not in markers):
        raise ValueError("markers must be non-empty, and before one of them")
    states = sorted({m[:i] for m in markers for i in range(len(m))}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(states)}
    alphabet = sorted({c for m in markers for c in m})

    def step(state: str, ch: str) -> str | None:
        text = state + ch
        if any(text.endswith(m) for m in markers):
            return None
        return next(text[i:] for i in range(len(text) + 1) if text[i:] in index)

    edges: dict[tuple[int, int], str] = {}
    for state in states:
        by_target: dict[int, set[str]] = {}
        for ch in alphabet:
            target = step(state, ch)
            if target is not None:
                by_target.setdefault(index[target], set()).add(ch)
        leaving = set(alphabet) - by_target.pop(0, set())
        labels = {0: char_class(leaving, negate=True) if leaving else ANY}
        labels.update({t: char_class(chars) for t, chars in by_target.items()})
        for target, label in labels.items():
            edges[(index[state], target)] = label

    def opens_before(state: str) -> bool:
        for i, ch in enumerate(before):
            text = state + ch
            if any(text.endswith(m) for m in markers):
                return i == len(before) - 1 and text.endswith(before)
            state = step(state, ch)
        return False

    finals = [index[s] for s in states if before is None or opens_before(s)]
    return "(" + _eliminate(len(states), edges, finals) + ")"


def _marker_first_ends_at_end(marker: str, table: list[int], state: int) -> bool:
    for i, ch in enumerate(marker):
        state = next_state(marker, table, state, ch)
        if state == len(marker):
            return i == len(marker) - 1
    return False


# ---------------------------------------------------------------- text not starting with words

def not_starting_with(words: list[str]) -> str:
    """Regex of the texts that, after JSON whitespace, do not begin with the first character of any of
    ``words`` (a stricter rule than "not with the words": a trie of the words' prefixes, each ending in free
    text, makes outlines-core's DFA explode once the regex is end-anchored)."""
    firsts = {w[0] for w in words if w}
    return WS_CLASS + "*(" + char_class(firsts | set(WHITESPACE), negate=True) + ANY + "*)?"
