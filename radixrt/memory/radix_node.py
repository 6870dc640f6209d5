"""The radix tree's nodes, the index of their children, and what a lookup or an insert returns.

Shape
-----
Every edge of the tree holds a key of token ids whose length is a whole number of pages
(``len(key) % page_size == 0``, never empty) and the page ids that hold those tokens' KV, one per
``page_size`` tokens; only the root's key and pages are empty. A node's children are keyed by the tuple
of their first page's tokens (by the first token when ``page_size == 1``, see :func:`child_key`), so one
dict lookup finds the child that shares a whole first page. With ``page_size > 1`` each node also keeps
its children's first pages in a sorted list (``firsts``): the child whose first page shares the most
tokens with a partial page sits next to that page's bisection point, so :func:`best_partial_child`
finds it in O(log children) without a scan.

The helpers here keep ``children`` and ``firsts`` in step and touch nothing else: locks, access times
of the path, page ownership and the cache's counters are :class:`~radixrt.memory.radix_cache.RadixCache`'s.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass


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


def child_key(key: tuple, page_size: int, pos: int = 0):
    """The key under which an edge starting at ``key[pos]`` sits in its parent's ``children``."""
    return key[pos] if page_size == 1 else key[pos : pos + page_size]


def add_child(parent: TreeNode, child: TreeNode, page_size: int) -> None:
    parent.children[child_key(child.key, page_size)] = child
    if page_size > 1:
        insort(parent.firsts, child.key[:page_size])


def remove_child(parent: TreeNode, child: TreeNode, page_size: int) -> None:
    del parent.children[child_key(child.key, page_size)]
    if page_size > 1:
        firsts = parent.firsts
        del firsts[bisect_left(firsts, child.key[:page_size])]


def split_edge(node: TreeNode, at: int, page_size: int, uid: int) -> TreeNode:
    """Split ``node``'s edge after ``at`` tokens (0 < at < len, page-aligned); return the new upper node.

    The existing node keeps its identity as the lower half, so locks held on it stay valid; the upper
    node (``uid``) copies its lock count (every lock on the node also locks its ancestors) and access time.
    """
    parent = node.parent
    upper = TreeNode(node.key[:at], node.pages[: at // page_size], parent, node.last_access, uid)
    upper.lock_ref = node.lock_ref
    parent.children[child_key(node.key, page_size)] = upper  # same first page: `firsts` is unchanged
    node.key = node.key[at:]
    node.pages = node.pages[at // page_size :]
    node.parent = upper
    add_child(upper, node, page_size)
    return upper


def best_partial_child(node: TreeNode, key: tuple, pos: int, page_size: int) -> tuple[TreeNode | None, int]:
    """The child of ``node`` whose first page shares the most (< page_size) leading tokens with key[pos:]."""
    firsts = node.firsts
    want = key[pos : pos + page_size]
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
    assert best_len < page_size
    return node.children[best], best_len
