"""Stop regexes (SGLang's ``stop_regex`` sampling parameter): a match anywhere in a request's output ends it, and the
output is cut where the match starts, exactly as at a stop string (radixrt.detokenize.TextStream applies both).

Patterns use Python's ``re`` syntax and are compiled with the ``regex`` package, whose partial matching tells a
stream how much text may still become a match (that text is held back, as a stop string's prefix is). A pattern
that does not compile, or that matches the empty string (it would end every output before it starts), is refused.
Torch-free; imports nothing of the runtime.
"""

from __future__ import annotations

from functools import lru_cache

import regex

MAX_PATTERN_CHARS = 1000


@lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> "regex.Pattern[str]":
    """The compiled pattern; ``ValueError`` naming what is wrong with it."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("stop_regex patterns must be non-empty strings")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"a stop_regex pattern may have at most {MAX_PATTERN_CHARS} characters")
    try:
        compiled = regex.compile(pattern, regex.VERSION0)
    except (regex.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"invalid stop_regex {pattern!r}: {exc}") from None
    if compiled.search("") is not None:
        raise ValueError(f"stop_regex {pattern!r} matches the empty string")
    return compiled


def check_stop_regexes(patterns: list[str]) -> None:
    for pattern in patterns:
        compile_stop_regex(pattern)


def first_match(patterns: list[str], text: str) -> tuple[int, str] | None:
    """(where the earliest match in ``text`` starts, its pattern), or None."""
    hits = []
    for pattern in patterns:
        m = compile_stop_regex(pattern).search(text)
        if m is not None:
            hits.append((m.start(), pattern))
    return min(hits) if hits else None


def may_match_from(patterns: list[str], text: str, pos: int) -> int:
    """The earliest index at or after ``pos`` from which ``text`` plus more text could still match: ``len(text)``
    when no pattern can."""
    start = len(text)
    for pattern in patterns:
        m = compile_stop_regex(pattern).search(text, pos, partial=True)
        if m is not None:
            start = min(start, m.start())
    return start
