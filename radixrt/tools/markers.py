"""Finding a fixed marker (``<tool_call>``, ``[TOOL_CALLS]``) in text that arrives piece by piece.

``MarkerMatcher`` runs the Knuth-Morris-Pratt automaton of one marker over characters: it holds back exactly
the longest tail that is still a prefix of the marker and releases everything else. The same automaton
(``next_state``) builds the constraint regexes' "text that does not contain the marker"
(radixrt.tools.regex), so the parser and the regex agree on where a marker starts.
"""

from __future__ import annotations


def failure_table(marker: str) -> list[int]:
    """KMP's table: ``table[i]`` is the length of the longest proper border of ``marker[: i + 1]``."""
    table = [0] * len(marker)
    k = 0
    for i in range(1, len(marker)):
        while k and marker[i] != marker[k]:
            k = table[k - 1]
        if marker[i] == marker[k]:
            k += 1
        table[i] = k
    return table


def next_state(marker: str, table: list[int], matched: int, ch: str) -> int:
    """How much of ``marker`` is matched after ``ch``, given ``matched`` characters before it
    (``matched < len(marker)``); ``len(marker)`` means the marker just ended."""
    while matched and marker[matched] != ch:
        matched = table[matched - 1]
    return matched + 1 if marker[matched] == ch else 0


class MarkerMatcher:
    """Looks for ``marker`` in a character stream; ``held`` is the possible start of it seen so far."""

    def __init__(self, marker: str):
        self.marker = marker
        self._table = failure_table(marker)
        self.matched = 0

    @property
    def held(self) -> str:
        return self.marker[: self.matched]

    def step(self, ch: str) -> tuple[str, bool]:
        """(text now known not to belong to the marker, whether the marker just ended)."""
        before = self.matched
        after = next_state(self.marker, self._table, before, ch)
        released = (self.marker[:before] + ch)[: before + 1 - after]
        if after == len(self.marker):
            self.matched = 0
            return released, True
        self.matched = after
        return released, False

    def reset(self) -> str:
        """Forget the held text and return it."""
        held = self.held
        self.matched = 0
        return held
