r"""Regexes of free text around markers, for constraints whose output mixes text with structured parts (tool
calls, reasoning blocks, structural tags).

- ``text_without_any(markers, before)``: any text holding none of ``markers``; with ``before`` (one of them), the
  texts that ``before`` may follow as the first marker to occur (a text ending in a proper prefix of a marker
  must not let the marker start sooner). Built mechanically: an automaton over the markers' prefixes, turned
  into a regex by state elimination (``eliminate``).
- ``char_class``, ``class_char``, ``alternation``: the pieces, escaped for both engines (``<`` and ``>`` stay bare: ``\<`` is a
  word boundary in Rust).
Torch-free.
"""

from __future__ import annotations

from functools import lru_cache

from radixrt.constrained.patterns import escape

# Any character but the grammar's end-of-match one (radixrt.constrained.grammar.end_anchored): free text that
# could also spell the end would make the token index explode.
END = "\uFFFF"
ANY = "[^" + END + "]"


def alternation(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


def char_class(chars: set[str], negate: bool = False) -> str:
    if negate:
        chars = chars | {END}
    body = "".join(class_char(c) for c in sorted(chars))
    if not negate and len(chars) == 1:
        return escape(next(iter(chars)))
    return "[" + ("^" if negate else "") + body + "]"


def class_char(c: str) -> str:
    """One character inside a ``[...]`` class, escaped for both engines."""
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c) or ("\\" + c if c in "\\]^-[&~" else c)


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


def eliminate(n: int, edges: dict[tuple[int, int], str], finals: list[int]) -> str:
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
    return "(" + eliminate(len(states), edges, finals) + ")"
