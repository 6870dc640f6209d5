"""Helpers over token-id sequences shared by the cache, the scheduler and constrained decoding.

Imports nothing: any layer may use it.
"""

from __future__ import annotations

from typing import Sequence

_CHUNK = 64  # tokens compared per slice (one C-level comparison) before the item-by-item scan


def common_prefix_len(a: Sequence[int], b: Sequence[int], b_start: int = 0, known: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[b_start:]``, given that their first ``known`` items agree.

    ``a`` and ``b`` must be the same kind of sequence (two lists or two tuples) for the sliced comparison.
    """
    limit = min(len(a), len(b) - b_start)
    i = known
    while i + _CHUNK <= limit and a[i : i + _CHUNK] == b[b_start + i : b_start + i + _CHUNK]:
        i += _CHUNK
    end = min(i + _CHUNK, limit)
    while i < end and a[i] == b[b_start + i]:
        i += 1
    return i
