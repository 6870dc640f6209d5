"""The KV pages of requests: the only code that changes a request's ``pages``, ``node`` and ``num_tree_pages``.

A request's page table is ``req.pages``: ``pages[:num_tree_pages]`` belong to the radix tree and are
protected from eviction by a lock on ``req.node`` (the deepest cached node of its path); the rest are
private to the request, one reference each. A page's single reference belongs to the tree or to the one
request that allocated it: a request never frees a tree page, the tree never frees a private page.
``req.num_computed`` counts the tokens whose K/V those pages hold; it is set here when pages are taken or
given back, and advanced by the output step as the forward computes tokens.

- ``hold`` locks a matched path while admission weighs a request (``unhold`` if it does not fit);
  ``take_match`` then gives the request the matched pages, plus a private copy of a partially matched page.
- ``reserve`` gives a planned batch the pages its new tokens need: evict cached pages, then release sessions'
  pins (``unpin``, radixrt.scheduler.sessions) and evict again, then retract running
  requests (the lowest priority first, then the fewest outputs), then allocate.
- ``reserve_without_retraction`` does the same short of retracting (overlap scheduling: a step launched
  ahead of the previous one's tokens must not retract a request whose token is in flight).
- ``grant_draft`` gives a speculative draft pages (free ones, then evicting cached pages no request holds;
  never retracting nor unpinning), ``trim`` frees a request's pages past its next token (rejected drafts).
- ``cache_prefix`` (after a prefill chunk) puts computed whole pages in the tree for others to share.
- ``release`` (finish, abort, retraction, failed batch) inserts computed whole pages in the tree, frees the
  private pages the tree did not keep, unlocks the path and empties the table.
- ``check`` asserts the page accounting.

Each change of a request's pages is written to ``rows`` too (radixrt.scheduler.page_rows), from which every forward
batch takes its page table in one gather.

Only tokens that can no longer change go into the tree (``Req.final_len``): a constrained request's unsent output
may still be re-tokenised by jump-forward.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from radixrt.memory.page_pool import OutOfPagesError, PagePool
from radixrt.memory.radix_cache import RadixCache
from radixrt.scheduler.page_rows import PageRows
from radixrt.scheduler.request import Req

if TYPE_CHECKING:
    from radixrt.memory.radix_cache import MatchResult, TreeNode
    from radixrt.scheduler.batch import Plan


class Memory:
    def __init__(self, pool: PagePool, cache: RadixCache, page_size: int, low_priority_first: bool = False) -> None:
        self.pool = pool
        self.cache = cache
        self.page_size = page_size
        # Sessions' pins (radixrt.scheduler.sessions): release the least recently used ones for this many pages;
        # set by the scheduler. Pins yield before a request waits or a running one is retracted.
        self.unpin: Callable[[int], int] | None = None
        self.low_priority_first = low_priority_first  # --schedule-low-priority-values-first
        self.rows = PageRows()

    @property
    def available_pages(self) -> int:
        """Pages a new request could get: free ones plus cached ones no request holds."""
        return self.pool.num_free + self.cache.evictable_pages

    # ----- admission --------------------------------------------------------------------------------

    def hold(self, node: TreeNode) -> None:
        """Protect a matched path from eviction while admission decides (then ``take_match`` or ``unhold``)."""
        self.cache.lock(node)

    def unhold(self, node: TreeNode) -> None:
        self.cache.unlock(node)

    def take_match(self, req: Req, match: MatchResult) -> None:
        """A request admitted with ``match`` (held): its page table starts with the matched tree pages."""
        req.node = match.node
        req.pages = list(match.pages)
        req.num_tree_pages = len(match.pages)
        req.num_computed = match.num_tokens
        reused = self.cache.reuse_partial(match) if match.partial_tokens else None
        if reused is not None:
            page, tokens = reused
            req.pages.append(page)
            req.num_computed += tokens
        self.rows.write(req)

    # ----- a batch's pages ----------------------------------------------------------------------------

    def _page_needs(self, plan: Plan) -> list[tuple[Req, int]]:
        """The planned requests that need new pages for their tokens, and how many each."""
        page = self.page_size
        needs = []
        for r, n in plan:
            need = (r.num_computed + n + page - 1) // page - len(r.pages)
            if need > 0:
                needs.append((r, need))
        return needs

    def _pages_short(self, needs: list[tuple[Req, int]]) -> int:
        return sum(need for _, need in needs) - self.pool.num_free

    def _make_room(self, needs: list[tuple[Req, int]]) -> int:
        """Evict cached pages, then release sessions' pins and evict again, until ``needs`` fit; the pages still
        short. A pin can free fewer pages than it held (a running turn of its session holds the same path), so
        pins are released until the needs fit or none is left."""
        short = self._pages_short(needs)
        if short > 0:
            self.cache.evict(short)
            short = self._pages_short(needs)
        while short > 0 and self.unpin is not None and self.unpin(short):
            self.cache.evict(short)
            short = self._pages_short(needs)
        return short

    def reserve(self, plan: Plan, running: list[Req], admitted_now: set[int]) -> tuple[Plan, list[Req]]:
        """Give every planned request the pages its new tokens need: evict, then retract if that is not enough.

        Returns the plan without the retracted requests, and those requests (pages released, still in
        ``running``): the caller puts them back in the waiting queue. ``admitted_now`` holds the ids of the
        requests admitted this step.
        """
        needs = self._page_needs(plan)
        short = self._make_room(needs)
        candidates = list(running)
        retracted: list[Req] = []
        while short > 0:
            if len(candidates) == 1:
                raise OutOfPagesError("a single request does not fit in the KV pool")  # prevented by validate()
            # The least urgent priority first; then the fewest outputs lose the least work, and a request
            # admitted this step goes last, since its admission counted on the room.
            victim = min(candidates, key=lambda r: (r.urgency(self.low_priority_first), id(r) in admitted_now,
                                                    len(r.output_ids), -r.arrival))
            candidates.remove(victim)
            self.release(victim)
            retracted.append(victim)
            plan = [(r, n) for r, n in plan if r is not victim]
            needs = [(r, need) for r, need in needs if r is not victim]
            self.cache.evict(max(self._pages_short(needs), 0))
            short = self._pages_short(needs)
        self._allocate(needs)
        return plan, retracted

    def _allocate(self, needs: list[tuple[Req, int]]) -> None:
        for req, need in needs:
            held = len(req.pages)
            req.pages.extend(self.pool.alloc(need))
            self.rows.write(req, held)

    def reserve_without_retraction(self, plan: Plan) -> bool:
        """Give every planned request the pages its new tokens need, evicting cached pages and sessions' pins
        if need be; False (and nothing allocated) when that is not enough."""
        needs = self._page_needs(plan)
        if self._make_room(needs) > 0:
            return False
        self._allocate(needs)
        return True

    def grant_draft(self, req: Req, num_tokens: int) -> int:
        """Pages for up to ``num_tokens`` draft tokens after the request's next token (whose page is reserved);
        returns how many draft tokens the request's pages now cover."""
        need = math.ceil((req.num_computed + 1 + num_tokens) / self.page_size) - len(req.pages)
        if need > 0:
            short = need - self.pool.num_free
            if short > 0:
                self.cache.evict(short)
            granted = min(need, self.pool.num_free)
            if granted:
                held = len(req.pages)
                req.pages.extend(self.pool.alloc(granted))
                self.rows.write(req, held)
        return min(num_tokens, len(req.pages) * self.page_size - req.num_computed - 1)

    def trim(self, req: Req) -> None:
        """Free the request's private pages past the one its next token goes to (after a verify step)."""
        keep = max(math.ceil((req.num_computed + 1) / self.page_size), req.num_tree_pages)
        if len(req.pages) > keep:
            self.pool.decref(req.pages[keep:])
            del req.pages[keep:]
            self.rows.write(req, keep)

    def cache_prefix(self, req: Req) -> None:
        """After a prefill chunk: put the request's computed whole pages in the tree for others to share."""
        whole = min(req.num_computed, req.final_len) // self.page_size
        if self.cache.disabled or whole <= req.num_tree_pages:
            return
        result = self.cache.insert(req.fill_ids[: whole * self.page_size], req.pages[:whole], req.cache_namespace)
        kept = set(result.tree_pages)
        self.pool.decref([p for p in result.duplicates if p not in kept])
        req.pages[: len(result.tree_pages)] = result.tree_pages
        self.rows.write(req)
        self.cache.lock(result.node)  # the new node before unlocking the old: the shared path stays locked
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node = result.node
        req.num_tree_pages = len(result.tree_pages)

    def release(self, req: Req) -> None:
        """Hand the request's computed whole pages to the cache, free the rest, unlock its path."""
        if req.node is None and not req.pages:
            return
        whole = min(min(req.num_computed, req.final_len) // self.page_size, len(req.pages))
        result = self.cache.insert(req.fill_ids[: whole * self.page_size], req.pages[:whole], req.cache_namespace)
        kept = set(result.tree_pages)
        private = [p for p in req.pages[req.num_tree_pages :] if p not in kept]
        self.pool.decref(private)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node, req.pages, req.num_tree_pages = None, [], 0
        req.num_computed = 0
        self.rows.drop(req)

    # ----- health -------------------------------------------------------------------------------------

    def check(self, running: list[Req]) -> None:
        """Page accounting invariants: every page is free, cached or private to exactly one running request."""
        private = [p for r in running for p in r.pages[r.num_tree_pages :]]
        assert len(private) == len(set(private)), "a private page is listed twice"
        self.cache.check(private)
        total = self.pool.num_free + self.cache.cached_pages + len(private)
        assert total == self.pool.num_pages, f"pages leak: free+cached+private={total} of {self.pool.num_pages}"
        self.rows.check(running)
