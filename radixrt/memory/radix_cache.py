"""Radix-tree prefix cache: token-id prefixes -> the physical KV pages that hold them.

Shape
-----
Every edge of the tree holds a key of token ids whose length is a whole number of pages
(``len(key) % page_size == 0``, never empty) and the page ids that hold those tokens' KV, one per
``page_size`` tokens. A node's children are keyed by the tuple of their first page's tokens (by the
first token when ``page_size == 1``), so one dict lookup finds the child that shares a whole first
page. With ``page_size > 1`` each node also keeps its children's first pages in a sorted list: the
child whose first page shares the most tokens with a partial page (see *partial-page reuse*) sits
next to that page's bisection point, so it is found in O(log children) without a scan.

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

Stats
-----
``match_prefix`` counts hit (page-aligned matched) and miss (``len(tokens) - hit``) tokens unless
called with ``record=False`` (use that for look-ahead matches, e.g. by a scheduling policy, so a
request is counted once, at admission; or match with ``record=False`` and call ``record(hit, total)``
once the request is actually admitted). ``reuse_partial`` counts the tokens it saved; ``evict``
counts freed pages. ``reset`` (a flush) is not counted as eviction.

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

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, count
from operator import ne

from radixrt.memory.page_pool import PagePool
from radixrt.token_ids import common_prefix_len


class TreeNode:
    """One edge of the tree (and the node below it). ``key``/``pages`` are empty only at the root."""

    __slots__ = ("key", "pages", "parent", "children", "firsts", "lock_ref", "last_access", "alive", "uid")

    def __init__(self, key: tuple, pages: list[int], parent: TreeNode | None, last_access: int, uid: int) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict = {}
        # page_size > 1 only: the children's first pages (their keys in `children`), sorted, so the child
        # sharing the longest prefix with a partial page is a neighbour of its bisection point.
        self.firsts: list[tuple] = []
        self.lock_ref = 0
        self.last_access = last_access
        self.alive = True
        self.uid = uid

    def __repr__(self) -> str:
        head = list(self.key[:8])
        return (
            f"TreeNode(uid={self.uid}, tokens={len(self.key)}{head}{'...' if len(self.key) > 8 else ''}, "
            f"pages={self.pages[:4]}{'...' if len(self.pages) > 4 else ''}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access})"
        )


@dataclass
class MatchResult:
    pages: list[int]  # tree pages of the page-aligned matched prefix
    num_tokens: int  # len(pages) * page_size
    node: TreeNode  # deepest node covering the match (root when nothing matched); lock it to protect `pages`
    partial_page: int | None = None  # tree page holding the next `partial_tokens` matching tokens, else None
    partial_tokens: int = 0  # 0..page_size-1
    partial_node: TreeNode | None = None  # the node whose first page is `partial_page` (child of `node`)


@dataclass
class InsertResult:
    node: TreeNode  # deepest node of the inserted sequence (lock it if the request keeps running)
    tree_pages: list[int]  # the tree's pages for the whole inserted sequence: repoint the page table to these
    duplicates: list[int]  # caller pages the tree already had under the same tokens: the caller decrefs them


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


class RadixCache:
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
    def _child_key(self, key: tuple, pos: int = 0):
        return key[pos] if self.page_size == 1 else key[pos : pos + self.page_size]

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

    def _add_child(self, parent: TreeNode, child: TreeNode) -> None:
        parent.children[self._child_key(child.key)] = child
        if self.page_size > 1:
            insort(parent.firsts, child.key[: self.page_size])

    def _remove_child(self, parent: TreeNode, child: TreeNode) -> None:
        del parent.children[self._child_key(child.key)]
        if self.page_size > 1:
            firsts = parent.firsts
            del firsts[bisect_left(firsts, child.key[: self.page_size])]

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node``'s edge after ``at`` tokens (0 < at < len, page-aligned); return the new upper node.

        The existing node keeps its identity as the lower half, so locks held on it stay valid; the
        upper node copies its lock count (every lock on the node also locks its ancestors) and access time.
        """
        page_size = self.page_size
        parent = node.parent
        upper = TreeNode(node.key[:at], node.pages[: at // page_size], parent, node.last_access, next(self._uids))
        upper.lock_ref = node.lock_ref
        first = self._child_key(node.key)
        parent.children[first] = upper
        node.key = node.key[at:]
        node.pages = node.pages[at // page_size :]
        node.parent = upper
        self._add_child(upper, node)
        self._num_nodes += 1
        return upper

    # ----------------------------------------------------------------------------------- match
    def match_prefix(self, tokens: Sequence[int], *, record: bool = True) -> MatchResult:
        """The longest cached page-aligned prefix of ``tokens`` (see the module docstring)."""
        key = tuple(tokens)
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
            partial_node, partial_tokens = self._best_partial(node, key, pos)
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

    def _best_partial(self, node: TreeNode, key: tuple, pos: int) -> tuple[TreeNode | None, int]:
        """The child of ``node`` whose first page shares the most (< page_size) leading tokens with key[pos:]."""
        firsts = node.firsts
        want = key[pos : pos + self.page_size]
        i = bisect_left(firsts, want)
        best, best_len = None, 0
        # In sorted order the longest common prefix with `want` is found next to its insertion point.
        for first_page in firsts[max(i - 1, 0) : i + 1]:
            matched = 0
            for a, b in zip(first_page, want):
                if a != b:
                    break
                matched += 1
            if matched > best_len:
                best, best_len = first_page, matched
        if best is None:
            return None, 0
        # A whole matching first page would have been found by the exact lookup.
        assert best_len < self.page_size
        return node.children[best], best_len

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
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Record ``tokens`` (whole pages only) held in ``pages``; see the ownership rule above."""
        page_size = self.page_size
        if len(tokens) != len(pages) * page_size:
            raise ValueError(
                f"insert needs whole pages: {len(tokens)} tokens for {len(pages)} pages of {page_size}"
            )
        if self.disabled:
            return InsertResult(self.root, [], [])
        key = tuple(tokens)
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
                self._add_child(node, child)
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
                self._remove_child(parent, node)
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
    def nodes(self) -> Iterable[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

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
        pool = self.pool
        page_size = self.page_size
        refs = pool.ref_counts
        root = self.root
        assert root.alive and root.lock_ref == 1 and not root.key and not root.pages, "the root was modified"
        tree_pages: list[int] = []
        evictable = protected = nodes = 0
        evictable_leaves: set[int] = set()
        stack = [root]
        while stack:
            parent = stack.pop()
            child_locks = 0
            for ck, node in parent.children.items():
                nodes += 1
                where = f"node {node!r}"
                assert node.alive, f"{where}: dead node still linked in the tree"
                assert node.parent is parent, f"{where}: wrong parent link"
                assert node.key and len(node.key) % page_size == 0, f"{where}: key not whole pages"
                assert len(node.key) == len(node.pages) * page_size, f"{where}: key/pages length mismatch"
                assert ck == self._child_key(node.key), f"{where}: stored under the wrong child key {ck!r}"
                assert node.lock_ref >= 0, f"{where}: negative lock_ref"
                assert node.last_access <= parent.last_access or parent is root, (
                    f"{where}: child used more recently than its parent {parent!r}"
                )
                child_locks += node.lock_ref
                if node.lock_ref:
                    protected += len(node.pages)
                else:
                    evictable += len(node.pages)
                    if not node.children:
                        evictable_leaves.add(node.uid)
                tree_pages.extend(node.pages)
                stack.append(node)
            if page_size > 1:
                assert parent.firsts == sorted(parent.children), (
                    f"node {parent!r}: sorted first-page index out of step with its children"
                )
            if parent is not root:
                assert child_locks <= parent.lock_ref, (
                    f"node {parent!r}: lock_ref {parent.lock_ref} below its children's total {child_locks}"
                )
        assert nodes == self._num_nodes, f"node count {self._num_nodes} != {nodes} nodes in the tree"
        assert evictable == self._evictable, f"evictable counter {self._evictable} != {evictable} unlocked tree pages"
        assert protected == self._protected, f"protected counter {self._protected} != {protected} locked tree pages"
        in_heap = {
            node.uid
            for stamp, _, node in self._heap
            if node.alive and not node.children and not node.lock_ref and node.last_access == stamp
        }
        missing = evictable_leaves - in_heap
        assert not missing, f"{len(missing)} evictable leaves missing from the LRU heap (would never be evicted)"

        tree_set = set(tree_pages)
        assert len(tree_set) == len(tree_pages), "a page is held by two tree positions"
        private = list(request_private_pages)
        private_set = set(private)
        assert len(private_set) == len(private), "a private page is listed twice (two requests own it?)"
        both = tree_set & private_set
        assert not both, f"pages both in the tree and private to a request: {sorted(both)[:10]}"
        free = pool._free
        free_set = set(free)
        assert len(free_set) == len(free), "a page is on the free list twice (double free)"
        owned = tree_set | private_set
        assert not (free_set & owned), f"free pages still in use: {sorted(free_set & owned)[:10]}"
        bad_tree = [p for p in tree_pages if refs[p] != 1]
        assert not bad_tree, f"tree pages with refcount != 1: {[(p, int(refs[p])) for p in bad_tree[:10]]}"
        bad_private = [p for p in private if refs[p] != 1]
        assert not bad_private, f"private pages with refcount != 1: {[(p, int(refs[p])) for p in bad_private[:10]]}"
        bad_free = [p for p in free if refs[p] != 0]
        assert not bad_free, f"free pages with refcount != 0: {bad_free[:10]}"
        total = pool.num_pages
        accounted = len(free) + evictable + protected + len(private)
        if accounted != total:
            leaked = sorted(set(range(total)) - free_set - owned)
            raise AssertionError(
                f"free {len(free)} + evictable {evictable} + protected {protected} + private {len(private)} "
                f"= {accounted} != {total} pages; leaked (allocated, owned by nobody): {leaked[:10]}"
            )
