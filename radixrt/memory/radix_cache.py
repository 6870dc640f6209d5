"""Radix-tree prefix cache: token-id prefixes -> the physical KV pages that hold them.

The tree's shape (whole-page edges, children keyed by their first page) is in
:mod:`radixrt.memory.radix_node`, the counters in :mod:`radixrt.memory.radix_stats`, the invariant check
(``check()``) in :mod:`radixrt.memory.radix_check`. This module holds the operations: match, insert,
split, lock/unlock, LRU eviction, partial-page reuse, reset. ``TreeNode``, ``MatchResult``,
``InsertResult`` and ``CacheStats`` import from here too.

Ownership rule (the one SGLang uses; every insert and free site here follows it)
------------------------------------------------------------------------------------
* Every allocated page has exactly one reference (``PagePool`` refcount 1). Nothing in the runtime
  calls ``incref`` on KV pages.
* That single reference belongs either to the tree (once the page is inserted: ``insert`` takes it
  over from the caller) or to the one request that allocated it (a *private* page). A request never
  frees a tree page, and the tree never frees a private page.
* A running request protects the tree pages it reads (its matched prefix, and whatever it inserted
  while still running) by *locking* the node path: ``lock(node)`` adds one to ``lock_ref`` on the node
  and on every ancestor (root excluded); ``unlock(node)`` takes it back. Locking is per node path,
  not per page, so a page's refcount never changes while it sits in the tree.
* ``insert`` keeps the tree's pages where the tree already has the same tokens; the caller's pages
  at those positions that differ (``InsertResult.duplicates``) stay the caller's: it repoints its
  page table to ``InsertResult.tree_pages`` and then ``pool.decref``s the duplicates.
* Eviction frees only leaves with ``lock_ref == 0``, least recently used first, one reference each
  (``pool.decref`` returns the page to the free list). A leaf's pages are freed from its tail, so
  ``evict(n)`` frees exactly ``n`` pages when that many are evictable; a node whose last page goes
  is removed and its parent may become an evictable leaf.
* Hence, at every moment: ``free + evictable + protected + request-private == total pages``,
  which ``check()`` verifies (the scheduler's debug mode calls it after every step).

LRU order
---------
Access times come from a logical clock that ticks once per ``match_prefix`` / ``insert``; every node
on the matched or inserted path takes the current tick, so a parent is never older than its
children. Evictable leaves sit in a min-heap of ``(last_access, node)`` with lazy deletion: an
entry is pushed whenever a node becomes an unlocked leaf or a leaf's time changes, and stale
entries are dropped when they reach the top (the heap is rebuilt when stale entries outnumber the
nodes). Complexity: match and insert are O(depth + len(tokens)) with C-speed tuple slicing;
``lock``/``unlock`` are O(depth); ``evict(n)`` is O((leaves touched + stale entries) * log heap);
``evictable_pages``, ``protected_pages`` and ``cached_pages`` are O(1) counters.

Partial-page reuse (beyond SGLang and vLLM, which share whole pages only)
-------------------------------------------------------------------------
When a match ends inside a page (``MatchResult.partial_tokens > 0``), ``reuse_partial`` copies the
matched slots of that tree page into a fresh page that becomes the request's private page
(copy-on-write), so the request computes from ``num_tokens + partial_tokens`` instead of
recomputing up to ``page_size - 1`` tokens. On by default; ``partial_page_reuse=False`` turns it off.

Namespaces
----------
``match_prefix`` and ``insert`` take a ``namespace`` (0 by default): the same tokens in two namespaces are two
prefixes that never share pages. A request's namespace (``cache_namespace``) is its LoRA adapter's uid, and with
an isolation key (SGLang's ``extra_key``, vLLM's ``cache_salt``) a number drawn from the key as well; a LongRoPE
model's requests whose prompts outgrow its original context rotate every position otherwise, so they take
namespaces of their own. Inside the
tree a namespace's tokens are keyed as ``token + namespace * NAMESPACE_STRIDE`` (``namespaced``), so the tree
itself knows nothing of them.

``disabled=True`` (``--disable-radix-cache``): matches are empty, inserts keep nothing (the caller
keeps and frees all of its pages), so every request computes its prompt from scratch.

Call ``reuse_partial`` right after ``match_prefix`` (before other tree mutations); it re-validates
the match and declines (returns ``None``) if the source page moved.

Typical use by the scheduler (a request's page table is always: tree pages, then private pages)::

    m = cache.match_prefix(prompt[:-1])          # at least one token is left to compute
    cache.lock(m.node)
    table, start = list(m.pages), m.num_tokens
    if (cow := cache.reuse_partial(m)) is not None:
        table.append(cow[0]); start += cow[1]
    short = need - pool.num_free                 # need = pages still missing for the prompt
    if short > 0: cache.evict(short)
    table += pool.alloc(need)                    # private pages
    ...                                          # compute positions start.. into the table
    n = len(tokens) // P * P                     # finished, or a chunk done: cache whole pages
    r = cache.insert(tokens[:n], table[: n // P])
    table[: n // P] = r.tree_pages
    pool.decref(r.duplicates)
    if still_running:  cache.lock(r.node); cache.unlock(m.node)      # lock the new path first
    else:              cache.unlock(m.node); pool.decref(table[n // P :])   # the private tail
    # abort: cache.unlock(node); pool.decref(the private pages, i.e. table[tree_page_count:])
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Sequence
from itertools import compress, count
from operator import ne

from radixrt.memory.page_pool import PagePool
from radixrt.memory.radix_check import check_cache
from radixrt.memory.radix_node import (
    InsertResult,
    MatchResult,
    TreeNode,
    add_child,
    best_partial_child,
    remove_child,
    split_edge,
)
from radixrt.memory.radix_stats import CacheStats
from radixrt.token_ids import common_prefix_len

__all__ = ["CacheStats", "InsertResult", "MatchResult", "RadixCache", "TreeNode", "cache_namespace",
           "long_rope_namespace", "namespaced"]

NAMESPACE_STRIDE = 1 << 32  # above every token id
LONG_ROPE_BIT = 1 << 31  # above every adapter uid, below an isolation key's hash


def cache_namespace(adapter_uid: int, key: str | None) -> int:
    """The namespace of requests through LoRA adapter ``adapter_uid`` (0: the base model) with isolation key ``key``:
    the uid alone without a key; with one, above every uid, from the key's 64-bit hash."""
    if key is None:
        return adapter_uid
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return adapter_uid + ((digest + 1) << 32)


def long_rope_namespace(namespace: int) -> int:
    """The namespace a request of ``namespace`` takes when a LongRoPE model rotates its sequence long (every position:
    K/V no request rotated short computes): bit 31 set, above every adapter uid, below the key's hash."""
    return namespace | LONG_ROPE_BIT


def namespaced(tokens: Sequence[int], namespace: int) -> tuple[int, ...]:
    """``tokens`` as the tree keys them in ``namespace``."""
    if not namespace:
        return tuple(tokens)
    offset = namespace * NAMESPACE_STRIDE
    return tuple(t + offset for t in tokens)


def plain(tokens: Sequence[int], namespace: int) -> list[int]:
    """The token ids of keys read from the tree in ``namespace``."""
    offset = namespace * NAMESPACE_STRIDE
    return [t - offset for t in tokens] if namespace else list(tokens)


class RadixCache:
    """The prefix cache over one ``PagePool``; the module docstring holds its rules."""

    def __init__(self, pool: PagePool, *, disabled: bool = False, partial_page_reuse: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.disabled = disabled
        self.partial_page_reuse = partial_page_reuse and not disabled and self.page_size > 1
        self.stats = CacheStats()
        self._uids = count()
        self._clock = 0
        self._new_root()

    def _new_root(self) -> None:
        self.root = TreeNode((), [], None, 0, next(self._uids))
        self.root.lock_ref = 1  # the root is never evicted (lock/unlock stop below it)
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._heap: list[tuple[int, int, TreeNode]] = []

    # ----------------------------------------------------------------------------------- sizes
    @property
    def evictable_pages(self) -> int:
        """Tree pages that no running request locks (all of them can be evicted, leaves first)."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Tree pages on some locked node path."""
        return self._protected

    @property
    def cached_pages(self) -> int:
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    # ----------------------------------------------------------------------------------- helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _push_if_evictable(self, node: TreeNode) -> None:
        if not node.children and node.lock_ref == 0 and node is not self.root:
            heapq.heappush(self._heap, (node.last_access, node.uid, node))
            if len(self._heap) > 2 * self._num_nodes + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                heap.append((node.last_access, node.uid, node))
        heapq.heapify(heap)
        self._heap = heap

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node``'s edge after ``at`` tokens (see :func:`split_edge`); return the new upper node."""
        self._num_nodes += 1
        return split_edge(node, at, self.page_size, next(self._uids))

    # ----------------------------------------------------------------------------------- match
    def match_prefix(self, tokens: Sequence[int], *, record: bool = True, namespace: int = 0) -> MatchResult:
        """The longest cached page-aligned prefix of ``tokens`` (see the module docstring)."""
        key = namespaced(tokens, namespace)
        n = len(key)
        if self.disabled:
            if record:
                self.stats.miss_tokens += n
            return MatchResult([], 0, self.root)
        page_size = self.page_size
        now = self._tick()
        node = self.root
        pos = 0
        pages: list[int] = []
        partial_node: TreeNode | None = None
        partial_tokens = 0
        while n - pos >= page_size:
            child = node.children.get(key[pos] if page_size == 1 else key[pos : pos + page_size])
            if child is None:
                break
            edge = child.key
            length = len(edge)
            if key[pos : pos + length] == edge:
                child.last_access = now
                pages.extend(child.pages)
                pos += length
                node = child
                continue
            matched = common_prefix_len(edge, key, pos, page_size)
            aligned = matched - matched % page_size
            upper = self._split(child, aligned)
            upper.last_access = now
            pages.extend(upper.pages)
            pos += aligned
            node = upper
            if matched > aligned and self.partial_page_reuse:
                partial_node, partial_tokens = child, matched - aligned
            break
        if partial_node is None and self.partial_page_reuse and pos < n:
            partial_node, partial_tokens = best_partial_child(node, key, pos, page_size)
        self._push_if_evictable(node)
        if record:
            self.stats.hit_tokens += pos
            self.stats.miss_tokens += n - pos
        return MatchResult(
            pages,
            pos,
            node,
            partial_node.pages[0] if partial_node is not None else None,
            partial_tokens,
            partial_node,
        )

    def record(self, hit_tokens: int, total_tokens: int) -> None:
        """Count a prefix lookup in the stats yourself (for callers that match with ``record=False``)."""
        self.stats.hit_tokens += hit_tokens
        self.stats.miss_tokens += total_tokens - hit_tokens

    def reuse_partial(self, match: MatchResult) -> tuple[int, int] | None:
        """Copy-on-write the matched slots of ``match.partial_page`` into a fresh private page.

        Returns ``(page, tokens)``: the new page belongs to the caller (refcount 1) and holds the KV of
        the ``tokens`` positions that follow ``match.num_tokens``. ``None`` when reuse is off, there is
        nothing to reuse, the match went stale, or no page can be had (one unlocked page may be evicted
        for it, never the source page or the matched path).
        """
        if not self.partial_page_reuse or match.partial_page is None or match.partial_tokens <= 0:
            return None
        node = match.partial_node
        if node is None or not node.alive or not node.pages or node.pages[0] != match.partial_page:
            return None
        pool = self.pool
        if pool.num_free == 0:
            self.lock(node)
            try:
                self.evict(1)
            finally:
                self.unlock(node)
            if pool.num_free == 0:
                return None
        (page,) = pool.alloc(1)
        pool.copy_page_prefix(match.partial_page, page, match.partial_tokens)
        self.stats.partial_tokens_reused += match.partial_tokens
        return page, match.partial_tokens

    # ----------------------------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int], pages: Sequence[int], namespace: int = 0) -> InsertResult:
        """Record ``tokens`` (whole pages only) held in ``pages``; see the ownership rule above."""
        page_size = self.page_size
        if len(tokens) != len(pages) * page_size:
            raise ValueError(
                f"insert needs whole pages: {len(tokens)} tokens for {len(pages)} pages of {page_size}"
            )
        if self.disabled:
            return InsertResult(self.root, [], [])
        key = namespaced(tokens, namespace)
        pages = list(pages)
        n = len(key)
        now = self._tick()
        node = self.root
        pos = 0
        tree_pages: list[int] = []
        duplicates: list[int] = []
        while pos < n:
            child = node.children.get(key[pos] if page_size == 1 else key[pos : pos + page_size])
            if child is None:
                new_pages = pages[pos // page_size :]
                child = TreeNode(key[pos:], new_pages, node, now, next(self._uids))
                add_child(node, child, page_size)
                self._num_nodes += 1
                self._evictable += len(new_pages)
                self.stats.inserted_pages += len(new_pages)
                tree_pages.extend(new_pages)
                node = child
                break
            edge = child.key
            length = len(edge)
            if key[pos : pos + length] != edge:
                matched = common_prefix_len(edge, key, pos, page_size)
                length = matched - matched % page_size
                child = self._split(child, length)
            child.last_access = now
            have = child.pages
            mine = pages[pos // page_size : (pos + length) // page_size]
            if mine != have:
                dup = list(compress(mine, map(ne, mine, have)))
                duplicates.extend(dup)
                self.stats.duplicate_pages += len(dup)
            tree_pages.extend(have)
            pos += length
            node = child
        self._push_if_evictable(node)
        return InsertResult(node, tree_pages, duplicates)

    # ----------------------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        """Protect the pages on the path root..node from eviction (lock_ref += 1 along it)."""
        if not node.alive:
            raise RuntimeError(f"lock of an evicted node {node!r}")
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                moved = len(node.pages)
                self._evictable -= moved
                self._protected += moved
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        if not node.alive:
            raise RuntimeError(f"unlock of an evicted node {node!r}")
        root = self.root
        while node is not root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of a node that is not locked: {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved = len(node.pages)
                self._evictable += moved
                self._protected -= moved
                if not node.children:
                    self._push_if_evictable(node)
            node = node.parent

    # ----------------------------------------------------------------------------------- eviction
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked LRU leaves (tail pages first); return how many."""
        if self.disabled or num_pages <= 0:
            return 0
        pool = self.pool
        page_size = self.page_size
        freed = 0
        while freed < num_pages and self._heap:
            heap = self._heap  # re-read: pushing a parent below may rebuild it
            stamp, _, node = heap[0]
            if not node.alive or node.children or node.lock_ref or node.last_access != stamp:
                heapq.heappop(heap)  # stale entry
                continue
            need = num_pages - freed
            if len(node.pages) <= need:
                heapq.heappop(heap)
                parent = node.parent
                remove_child(parent, node, page_size)
                node.alive = False
                self._num_nodes -= 1
                drop = node.pages
                node.pages = []
                node.key = ()
                pool.decref(drop)
                freed += len(drop)
                self._evictable -= len(drop)
                if not parent.children:
                    self._push_if_evictable(parent)
            else:
                drop = node.pages[-need:]
                node.pages = node.pages[:-need]
                node.key = node.key[: -need * page_size]
                pool.decref(drop)
                freed += need
                self._evictable -= need
        self.stats.evicted_pages += freed
        return freed

    def reset(self) -> None:
        """Flush the cache: free every tree page. Raises if a request still locks part of the tree."""
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked tree pages; unlock running requests first")
        pages: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            pages.extend(node.pages)
            node.alive = False
        self.pool.decref(pages)
        self._new_root()

    # ----------------------------------------------------------------------------------- debugging
    def snapshot(self) -> dict[tuple[int, ...], int]:
        """{token prefix ending at a page boundary: the page holding its last page}. For tests; O(tokens * depth)."""
        out: dict[tuple[int, ...], int] = {}
        page_size = self.page_size
        stack: list[tuple[TreeNode, tuple]] = [(c, ()) for c in self.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            for i, page in enumerate(node.pages):
                out[prefix + node.key[: (i + 1) * page_size]] = page
            full = prefix + node.key
            stack.extend((c, full) for c in node.children.values())
        return out

    def check(self, request_private_pages: Iterable[int] = ()) -> None:
        """Verify every invariant of the tree and the pool; raise AssertionError naming the first broken one.

        ``request_private_pages``: every page that running requests own (allocated, not in the tree).
        With the default ``()`` no request may hold a private page (the idle state).
        """
        check_cache(self, request_private_pages)
