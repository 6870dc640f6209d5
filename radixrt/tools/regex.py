r"""Regex pieces of the tool-call constraints (outlines-core / Rust regex syntax, also valid for Python's ``re``).

- ``arguments_regex``: a tool's arguments under its JSON schema (radixrt.constrained.patterns), cached.
- ``text_without(marker, before_marker)``: any text that does not contain ``marker``; with ``before_marker``,
  also the text may be followed by the marker without the marker occurring earlier (a text ending in a
  border of the marker would make the marker start sooner). Built mechanically: the marker's KMP automaton
  (radixrt.tools.markers, the parser's own) with the marker's last step removed, turned into a regex by state
  elimination.
- ``text_without_any(markers, before)``: the same for several markers (a reasoning block ends at ``</think>``
  and must not hold ``<tool_call>``), over the markers' prefixes; it lives in radixrt.constrained.text_regex
  (structural tags use it too) with ``char_class``, ``alternation`` and the state elimination, re-exported here.
- ``not_starting_with(words)``: any text that, after JSON whitespace, does not begin with the first character
  of one of ``words``.
Characters are escaped for both engines: ``<`` and ``>`` stay bare (``\<`` is a word boundary in Rust).
"""

from __future__ import annotations

import json
from functools import lru_cache

from radixrt.constrained.patterns import escape, json_schema_regex  # noqa: F401 - escape: re-exported
from radixrt.constrained.text_regex import ANY, char_class, eliminate
from radixrt.constrained.text_regex import alternation, text_without_any  # noqa: F401 - re-exported
from radixrt.tools.markers import failure_table, next_state
from radixrt.tools.scan import WHITESPACE

WS_CLASS = "[ \\t\\n\\r]"


@lru_cache(maxsize=256)
def _schema_regex(schema_json: str, json_whitespace: str) -> str:
    return json_schema_regex(json.loads(schema_json), json_whitespace)


def arguments_regex(tool, json_whitespace: str = "") -> str:
    """The JSON text of ``tool``'s arguments under its schema; ValueError when it does not compile."""
    return "(" + _schema_regex(json.dumps(tool.parameters, sort_keys=False), json_whitespace) + ")"


# ---------------------------------------------------------------- text without a marker

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
    return "(" + eliminate(m, edges, finals) + ")"


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
