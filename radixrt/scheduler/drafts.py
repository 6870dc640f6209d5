"""Draft tokens for speculative decoding, taken from text the runtime has already seen (no draft model).

Three sources, each asked for what followed the longest earlier occurrence of a request's latest tokens:

- the radix cache (``cache_continuation``): another request already continued this request's exact context;
  the tokens it wrote sit in the tree below the request's path. Every token of the context matches, so this
  is the strongest evidence (same prompt asked again, ``n`` > 1 siblings, a parallel branch redoing a step).
- the request's own context (``TokenIndex``): prompt lookup, the latest earlier occurrence of the longest
  suffix of prompt and output (a field copied from a document, a tool result quoted back, a plan repeated).
- the history (``History``): the same matching over a bounded window of recent requests' prompts and outputs
  (the same JSON shape written for another document, the same reply to the same kind of message).

How far a draft is likely to hold comes from all the earlier occurrences at once (``support``): the tokens
where they part ways are where a draft is likely to go wrong, as SuffixDecoding's counts of each continuation
tell it.

``TokenIndex`` keys every ``gram``-token window of a growing sequence by its tokens and chains each window to
the previous one with the same tokens, as LZ77's hash chains do: adding a token costs one tuple and one dict
update; a lookup walks at most ``chain_limit`` earlier windows, newest first, and measures how far back each
agrees with the query (up to ``max_window`` tokens). Matches are (end, length): the continuation starts at
``end``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from radixrt.memory.radix_node import TreeNode

CHAIN_LIMIT = 16  # earlier windows a lookup compares, newest first
HISTORY_WEIGHT = 0.5  # an occurrence in another request's text, against one in the request's own (``support``)
SEPARATOR = -1  # between the sequences of the history (no window with it is ever looked up)


@dataclass(frozen=True)
class Match:
    tokens: list[int]  # the proposed continuation
    length: int  # tokens of the query the match agrees with (the evidence)
    source: str  # "cache", "context" or "history"


class TokenIndex:
    """Suffix matches over one growing token sequence (see the module docstring)."""

    __slots__ = ("gram", "max_window", "tokens", "heads", "prev")

    def __init__(self, gram: int, max_window: int) -> None:
        self.gram = gram
        self.max_window = max(max_window, gram)
        self.tokens: list[int] = []
        self.heads: dict[tuple[int, ...], int] = {}  # window tokens -> end (exclusive) of its latest occurrence
        self.prev: list[int] = []  # prev[end - gram]: end of the previous occurrence of that window, or -1

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        tokens, heads, prev, gram = self.tokens, self.heads, self.prev, self.gram
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens)
            if end >= gram:
                key = tuple(tokens[end - gram:])
                prev.append(heads.get(key, -1))
                heads[key] = end

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (the windows they ended are unchained exactly)."""
        tokens, heads, prev, gram = self.tokens, self.heads, self.prev, self.gram
        while len(tokens) > length:
            end = len(tokens)
            if end >= gram:
                key = tuple(tokens[end - gram:])
                earlier = prev.pop()
                if earlier < 0:
                    del heads[key]
                else:
                    heads[key] = earlier
            tokens.pop()

    def occurrences(self, query: Sequence[int], skip_end: int = -1) -> Iterator[tuple[int, int]]:
        """The earlier occurrences of ``query``'s last ``gram`` tokens that the chain holds (``CHAIN_LIMIT`` windows,
        newest first), each as (its end, the tokens of ``query``'s end it agrees on, up to ``max_window``).
        ``skip_end``: an end never to give (the query's own, when the query is this index's sequence)."""
        gram = self.gram
        if len(query) < gram:
            return
        end = self.heads.get(tuple(query[len(query) - gram:]), -1)
        tokens, prev = self.tokens, self.prev
        longest = min(self.max_window, len(query))
        for _ in range(CHAIN_LIMIT):
            if end < 0:
                return
            if end != skip_end and end < len(tokens) and tokens[end] != SEPARATOR:
                agreed = gram
                while agreed < longest and end - agreed - 1 >= 0 and tokens[end - agreed - 1] == query[-agreed - 1]:
                    agreed += 1
                yield end, agreed
            end = prev[end - gram]

    def find(self, query: Sequence[int], skip_end: int = -1) -> tuple[int, int]:
        """The earlier occurrence agreeing longest with the end of ``query`` (the newest on ties): (its end, the
        tokens it agrees on); (-1, 0) when no window matches."""
        best_end, best_len = -1, 0
        longest = min(self.max_window, len(query))
        for end, agreed in self.occurrences(query, skip_end):
            if agreed > best_len:
                best_end, best_len = end, agreed
                if agreed == longest:
                    break
        return best_end, best_len

    def continuation(self, end: int, limit: int) -> list[int]:
        out = self.tokens[end : end + limit]
        if SEPARATOR in out:
            out = out[: out.index(SEPARATOR)]
        return out


class ContextIndex:
    """One request's prompt and output, indexed for suffix matches: long windows first, then short ones."""

    __slots__ = ("indexes", "final")

    def __init__(self, min_window: int, max_window: int) -> None:
        # A long window finds the right occurrence of a frequent token ("," or '"'); a short one still finds
        # something when the long one does not.
        long_gram = min(max(min_window, 3), max_window)
        self.indexes = [TokenIndex(long_gram, max_window)]
        if min_window < long_gram:
            self.indexes.append(TokenIndex(min_window, max_window))
        self.final = 0  # indexed tokens known final at the last sync

    def sync(self, tokens: Sequence[int], final: int) -> None:
        """Bring the index to ``tokens``, whose first ``final`` can no longer change (jump-forward may rewrite
        a constrained request's unsent tail): what differs since the last sync's final tokens is re-indexed."""
        indexed = self.indexes[0].tokens
        n = len(indexed)
        keep = min(self.final, n)
        while keep < n and keep < len(tokens) and indexed[keep] == tokens[keep]:
            keep += 1
        if keep < n:
            for index in self.indexes:
                index.truncate(keep)
        if keep < len(tokens):
            new = tokens[keep:]
            for index in self.indexes:
                index.extend(new)
        self.final = min(final, len(tokens))

    def match(self, limit: int) -> Match | None:
        for index in self.indexes:
            end, length = index.find(index.tokens, skip_end=len(index.tokens))
            if length:
                tokens = index.continuation(end, limit)
                return Match(tokens, length, "context") if tokens else None
        return None


class History:
    """Recent requests' prompts and outputs, indexed for suffix matches, in a bounded number of tokens.

    Sequences go into the newest of ``SEGMENTS`` segments; when it is full a new one starts and the oldest is
    dropped whole, so the memory is bounded and nothing is ever re-indexed."""

    SEGMENTS = 4

    def __init__(self, capacity_tokens: int, min_window: int, max_window: int) -> None:
        self.segment_tokens = max(capacity_tokens // self.SEGMENTS, 1)
        self.gram = min(max(min_window, 2), max_window)
        self.max_window = max_window
        self.segments: deque[TokenIndex] = deque([TokenIndex(self.gram, max_window)])

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def add(self, tokens: Sequence[int]) -> None:
        newest = self.segments[-1]
        if len(newest) and len(newest) + len(tokens) > self.segment_tokens:
            newest = TokenIndex(self.gram, self.max_window)
            self.segments.append(newest)
            if len(self.segments) > self.SEGMENTS:
                self.segments.popleft()
        newest.extend(tokens[-self.segment_tokens :])
        newest.extend((SEPARATOR,))

    def match(self, query: Sequence[int], limit: int) -> Match | None:
        best: tuple[int, int, TokenIndex] | None = None
        for segment in reversed(self.segments):  # the newest first: it wins ties
            end, length = segment.find(query)
            if length and (best is None or length > best[1]):
                best = (end, length, segment)
        if best is None:
            return None
        tokens = best[2].continuation(best[0], limit)
        return Match(tokens, best[1], "history") if tokens else None


def ngram_match(index: ContextIndex, history: History, tokens: Sequence[int], limit: int) -> Match | None:
    """The request's own suffix match (``index`` synced to ``tokens``), or the history's where that agrees on
    more tokens of the context."""
    own = index.match(limit)
    other = history.match(tokens[-history.max_window:], limit)
    if other is not None and (own is None or other.length > own.length):
        return other
    return own


def candidates(index: ContextIndex, history: History, tokens: Sequence[int], limit: int) -> list[Match]:
    """Every continuation the request's own context (``index`` synced to ``tokens``) and the history propose: each
    earlier occurrence of the latest tokens that the indexes' chains hold, once (the context's windows of two
    lengths find the same occurrences), the longest agreement first (the request's own, then the newest, on ties).
    What ``support`` weighs a draft by, and what a tree of candidates would draft from."""
    recent = tokens[-history.max_window:]
    searches = [("context", 0, ix, ix.tokens, len(ix.tokens)) for ix in index.indexes]
    searches += [("history", n + 1, segment, recent, -1) for n, segment in enumerate(reversed(history.segments))]
    found: list[Match] = []
    seen: set[tuple[int, int]] = set()
    for source, sequence, ix, query, skip_end in searches:
        for end, agreed in ix.occurrences(query, skip_end):
            if (sequence, end) in seen:
                continue
            seen.add((sequence, end))
            continuation = ix.continuation(end, limit)
            if continuation:
                found.append(Match(continuation, agreed, source))
    return sorted(found, key=lambda match: -match.length)  # stable: the order found on ties


def support(draft: Sequence[int], found: Sequence[Match]) -> list[tuple[float, float]]:
    """For each position ``k`` of ``draft``: the weight of the occurrences (``candidates``) whose continuation
    agrees with the draft through ``k``, and the weight of those that agree before ``k`` and go on to a token at
    ``k``. Where earlier occurrences part ways (a field's value after a shared key, a number after a shared
    phrase), the draft's token there is a guess; where they all go on alike (the next key, the rest of a quoted
    sentence), it is likely. An occurrence weighs the tokens of context it agrees on, an occurrence in another
    request's text ``HISTORY_WEIGHT`` as much: the longer and the closer the evidence, the more it counts."""
    alive = [(m.tokens, m.length * (HISTORY_WEIGHT if m.source == "history" else 1.0)) for m in found]
    out: list[tuple[float, float]] = []
    for k, token in enumerate(draft):
        agreeing = total = 0.0
        following = []
        for continuation, weight in alive:
            if k < len(continuation):
                total += weight
                if continuation[k] == token:
                    agreeing += weight
                    following.append((continuation, weight))
        out.append((agreeing, total))
        alive = following
    return out


def cache_continuation(node: TreeNode, tail: Sequence[int], page_size: int, limit: int) -> list[int]:
    """Up to ``limit`` tokens the radix tree holds after ``tail``, the request's tokens past ``node`` (its
    locked, deepest cached node); the most recently used branch where the tree forks. Read-only."""
    tail = tuple(tail)
    pos = 0
    while True:
        rest = len(tail) - pos
        if rest >= page_size:
            child = node.children.get(tail[pos] if page_size == 1 else tail[pos : pos + page_size])
            if child is None:
                return []
            edge = child.key
            agreed = min(len(edge), rest)
            if edge[:agreed] != tail[pos : pos + agreed]:
                return []
            if agreed < len(edge):
                out = list(edge[agreed : agreed + limit])
                return _descend(child, out, limit)
            node, pos = child, pos + agreed
            continue
        child = _latest_child_starting(node, tail[pos:], page_size)
        if child is None:
            return []
        out = list(child.key[rest : rest + limit])
        return _descend(child, out, limit)


def _latest_child_starting(node: TreeNode, head: tuple[int, ...], page_size: int) -> TreeNode | None:
    """The most recently used child whose edge starts with ``head`` (shorter than a page)."""
    if not node.children:
        return None
    if not head:
        return max(node.children.values(), key=lambda c: c.last_access)
    # page_size > 1 here: ``firsts`` holds the children's first pages, sorted; those starting with ``head``
    # are contiguous from its bisection point.
    firsts = node.firsts
    best = None
    for first in firsts[bisect_left(firsts, head):]:
        if first[: len(head)] != head:
            break
        child = node.children[first]
        if best is None or child.last_access > best.last_access:
            best = child
    return best


def _descend(node: TreeNode, out: list[int], limit: int) -> list[int]:
    while len(out) < limit and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out.extend(node.key[: limit - len(out)])
    return out
