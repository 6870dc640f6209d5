"""The radix cache's invariant check: the tree's shape, its counters and LRU heap, and page accounting.

:func:`check_cache` (``RadixCache.check``) verifies, and raises ``AssertionError`` naming the first broken rule:

* the shape: every linked node is alive, points to its parent, holds whole pages (key length ==
  pages * page_size), sits under its first page's child key, and (``page_size > 1``) its parent's sorted
  ``firsts`` index matches its children; a child is never used more recently than its parent;
* the locks: ``lock_ref >= 0``, and a node's children's locks never exceed its own;
* the counters: node count, evictable and protected pages match the tree; every evictable leaf has a
  live entry in the LRU heap;
* the pages: no page in two tree positions, in the tree and private, or free twice; tree and private
  pages have refcount 1 and free pages 0; and ``free + evictable + protected + request-private == total``.

It only reads; the scheduler's debug mode runs it after every step, so it stays O(nodes + pages).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixrt.memory.page_pool import PagePool
from radixrt.memory.radix_node import TreeNode, child_key

if TYPE_CHECKING:
    from radixrt.memory.radix_cache import RadixCache


@dataclass
class _TreeTally:
    """What a walk of the tree found, to compare with the cache's counters and the pool."""

    tree_pages: list[int] = field(default_factory=list)
    evictable: int = 0
    protected: int = 0
    nodes: int = 0
    evictable_leaves: set[int] = field(default_factory=set)


def check_cache(cache: RadixCache, request_private_pages: Iterable[int] = ()) -> None:
    """Verify every invariant of ``cache``'s tree and pool (see the module docstring).

    ``request_private_pages``: every page that running requests own (allocated, not in the tree).
    With the default ``()`` no request may hold a private page (the idle state).
    """
    root = cache.root
    assert root.alive and root.lock_ref == 1 and not root.key and not root.pages, "the root was modified"
    tally = _walk_tree(root, cache.page_size)
    _check_counters(cache, tally)
    _check_pages(cache.pool, tally, list(request_private_pages))


def _walk_tree(root: TreeNode, page_size: int) -> _TreeTally:
    tally = _TreeTally()
    stack = [root]
    while stack:
        parent = stack.pop()
        child_locks = 0
        for key, node in parent.children.items():
            _check_node(node, parent, key, root, page_size)
            tally.nodes += 1
            child_locks += node.lock_ref
            if node.lock_ref:
                tally.protected += len(node.pages)
            else:
                tally.evictable += len(node.pages)
                if not node.children:
                    tally.evictable_leaves.add(node.uid)
            tally.tree_pages.extend(node.pages)
            stack.append(node)
        if page_size > 1:
            assert parent.firsts == sorted(parent.children), (
                f"node {parent!r}: sorted first-page index out of step with its children"
            )
        if parent is not root:
            assert child_locks <= parent.lock_ref, (
                f"node {parent!r}: lock_ref {parent.lock_ref} below its children's total {child_locks}"
            )
    return tally


def _check_node(node: TreeNode, parent: TreeNode, key, root: TreeNode, page_size: int) -> None:
    where = f"node {node!r}"
    assert node.alive, f"{where}: dead node still linked in the tree"
    assert node.parent is parent, f"{where}: wrong parent link"
    assert node.key and len(node.key) % page_size == 0, f"{where}: key not whole pages"
    assert len(node.key) == len(node.pages) * page_size, f"{where}: key/pages length mismatch"
    assert key == child_key(node.key, page_size), f"{where}: stored under the wrong child key {key!r}"
    assert node.lock_ref >= 0, f"{where}: negative lock_ref"
    assert node.last_access <= parent.last_access or parent is root, (
        f"{where}: child used more recently than its parent {parent!r}"
    )


def _check_counters(cache: RadixCache, tally: _TreeTally) -> None:
    assert tally.nodes == cache.num_nodes, f"node count {cache.num_nodes} != {tally.nodes} nodes in the tree"
    assert tally.evictable == cache.evictable_pages, (
        f"evictable counter {cache.evictable_pages} != {tally.evictable} unlocked tree pages"
    )
    assert tally.protected == cache.protected_pages, (
        f"protected counter {cache.protected_pages} != {tally.protected} locked tree pages"
    )
    in_heap = {
        node.uid
        for stamp, _, node in cache._heap
        if node.alive and not node.children and not node.lock_ref and node.last_access == stamp
    }
    missing = tally.evictable_leaves - in_heap
    assert not missing, f"{len(missing)} evictable leaves missing from the LRU heap (would never be evicted)"


def _check_pages(pool: PagePool, tally: _TreeTally, private: list[int]) -> None:
    refs = pool.ref_counts
    tree_pages = tally.tree_pages
    tree_set = set(tree_pages)
    assert len(tree_set) == len(tree_pages), "a page is held by two tree positions"
    private_set = set(private)
    assert len(private_set) == len(private), "a private page is listed twice (two requests own it?)"
    both = tree_set & private_set
    assert not both, f"pages both in the tree and private to a request: {sorted(both)[:10]}"
    free = pool.free_page_ids()
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
    accounted = len(free) + tally.evictable + tally.protected + len(private)
    if accounted != total:
        leaked = sorted(set(range(total)) - free_set - owned)
        raise AssertionError(
            f"free {len(free)} + evictable {tally.evictable} + protected {tally.protected} + private {len(private)} "
            f"= {accounted} != {total} pages; leaked (allocated, owned by nobody): {leaked[:10]}"
        )
