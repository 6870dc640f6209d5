"""The radix cache's counters: hits and misses, evictions, partial-page reuse, page hand-overs.

``match_prefix`` counts hit (page-aligned matched) and miss (``len(tokens) - hit``) tokens unless called
with ``record=False`` (use that for look-ahead matches, e.g. by a scheduling policy, so a request is
counted once, at admission; or match with ``record=False`` and call ``record(hit, total)`` once the
request is actually admitted). ``reuse_partial`` counts the tokens it saved; ``evict`` counts freed
pages. ``reset`` (a flush) is not counted as eviction.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheStats:
    hit_tokens: int = 0
    miss_tokens: int = 0
    evicted_pages: int = 0
    partial_tokens_reused: int = 0
    inserted_pages: int = 0  # pages whose reference passed from a request to the tree
    duplicate_pages: int = 0  # caller pages reported as duplicates by insert

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "hit_rate": self.hit_rate,
            "evicted_pages": self.evicted_pages,
            "partial_tokens_reused": self.partial_tokens_reused,
            "inserted_pages": self.inserted_pages,
            "duplicate_pages": self.duplicate_pages,
        }
