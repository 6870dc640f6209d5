"""Orders the waiting queue: request priority first, then longest prefix match, SGLang's DFS weight over the
cache tree, or arrival order.

Priorities follow SGLang: a larger ``priority`` is more urgent unless ``--schedule-low-priority-values-first``
flips it; requests without one have priority 0. Within one priority the policy's order holds (the sort by
priority is stable), and so does the queue's own order for ties (retracted requests sit at its head).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from radixrt.scheduler.request import Req

if TYPE_CHECKING:
    from radixrt.memory.radix_cache import TreeNode

POLICIES = ("lpm", "dfs-weight", "fcfs")
# Matching every waiting request against the tree each step stops paying off for very long queues.
LPM_MAX_QUEUE = 256


def order_waiting(policy: str, waiting: list[Req], matches: dict[str, tuple[int, TreeNode]],
                  low_priority_first: bool = False) -> list[Req]:
    """``matches`` maps rid -> (matched tokens, deepest matched node) of every waiting request where
    ``orders_by_match``. Most urgent priority first, then the policy's order."""
    order = _policy_order(policy, waiting, matches)
    if any(r.priority != order[0].priority for r in order):
        order.sort(key=lambda r: -r.urgency(low_priority_first))  # stable: the policy's order within a level
    return order


def orders_by_match(policy: str, num_waiting: int) -> bool:
    """Whether ``order_waiting`` reads every waiting request's match (otherwise it may be computed only for the
    requests admission gets to)."""
    return policy != "fcfs" and num_waiting <= LPM_MAX_QUEUE


def _policy_order(policy: str, waiting: list[Req], matches: dict[str, tuple[int, TreeNode]]) -> list[Req]:
    if not orders_by_match(policy, len(waiting)):
        return list(waiting)
    if policy == "lpm":
        # Stable sort: equal matches keep arrival order.
        return sorted(waiting, key=lambda r: -matches[r.rid][0])
    if policy == "dfs-weight":
        return _dfs_weight(waiting, matches)
    raise ValueError(f"unknown schedule policy {policy!r}; choose one of {POLICIES}")


def _dfs_weight(waiting: list[Req], matches: dict[str, tuple[int, TreeNode]]) -> list[Req]:
    """Walk the cache tree from the root, heaviest subtree (most waiting requests) first, so that requests
    sharing a prefix run together while that prefix is cached."""
    at_node: dict[int, list[Req]] = defaultdict(list)
    children: dict[int, list[TreeNode]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    linked: set[tuple[int, int]] = set()
    root: TreeNode | None = None
    for req in waiting:
        node: TreeNode | None = matches[req.rid][1]
        at_node[id(node)].append(req)
        child: TreeNode | None = None
        while node is not None:
            weight[id(node)] += 1
            if child is not None and (id(node), id(child)) not in linked:
                linked.add((id(node), id(child)))
                children[id(node)].append(child)
            child, node = node, node.parent
        root = child
    order: list[Req] = []
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        order.extend(at_node.get(id(node), []))
        stack.extend(sorted(children.get(id(node), []), key=lambda c: weight[id(c)]))
    return order
