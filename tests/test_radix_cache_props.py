"""Model-based property tests of the radix cache (hypothesis stateful testing).

Random interleavings of requests that match, lock, copy a partial page, allocate, write KV, insert
(finishing or continuing), extend, abort, plus bare evictions, look-ahead matches and flushes, over
a small vocabulary and page sizes 1, 2, 4 and 16. After every step the tree is compared with a plain
reference model (a dict from each cached page-aligned prefix to its page, with per-page access
times), ``check()`` runs, and every page a request reads or the tree holds is checked to still carry
the KV written for its tokens (a page freed while locked and handed out again would not).
"""

import random
from collections import Counter
from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.memory.radix_cache import RadixCache

NUM_PAGES = 8
MAX_REQUESTS = 3
VOCAB = 3


def kv_of(tokens) -> tuple[np.ndarray, np.ndarray]:
    """The KV a request writes for each position: K = (token, position), V = (rolling hash of the prefix, 1)."""
    h = 0
    hashes = []
    for t in tokens:
        h = (h * 31 + t + 1) % 65521
        hashes.append(h)
    n = len(tokens)
    k = np.stack([np.asarray(tokens, dtype=np.float32), np.arange(n, dtype=np.float32)], axis=-1)
    v = np.stack([np.asarray(hashes, dtype=np.float32), np.ones(n, dtype=np.float32)], axis=-1)
    return k.reshape(n, 2), v.reshape(n, 2)


@dataclass
class Req:
    tokens: list[int]
    table: list[int]
    node: object
    lock_key: tuple
    private: set[int] = field(default_factory=set)
    computed: int = 0


class RadixMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1

    def __init__(self) -> None:
        super().__init__()
        p = self.P = self.PAGE_SIZE
        self.pool = PagePool(KVLayout(num_layers=1, kv_heads=1, head_dim=2, page_size=p, dtype=torch.float32), NUM_PAGES)
        self.cache = RadixCache(self.pool)
        self.k = self.pool.k_caches[0].numpy()[:, :, 0, :]  # [pages, page_size, 2] views
        self.v = self.pool.v_caches[0].numpy()[:, :, 0, :]
        self.ref: dict[tuple, int] = {}  # cached page-aligned prefix -> the page holding its last page
        self.times: dict[tuple, int] = {}
        self.clock = 0
        self.locks: Counter = Counter()  # locked paths (token prefixes), with multiplicity
        self.reqs: dict[int, Req] = {}
        self.next_rid = 0
        self.hit = self.miss = 0

    # ------------------------------------------------------------------ the reference model
    def protected(self, extra_paths=()) -> set[tuple]:
        out = set()
        for path in list(self.locks) + list(extra_paths):
            for i in range(self.P, len(path) + 1, self.P):
                out.add(path[:i])
        return out

    def model_evict(self, n: int, extra_paths=()) -> int:
        protected = self.protected(extra_paths)
        freed = 0
        while freed < n:
            has_child = {key[: -self.P] for key in self.ref}
            leaves = [key for key in self.ref if key not in has_child and key not in protected]
            if not leaves:
                break
            times = sorted(self.times[key] for key in leaves)
            assert len(times) < 2 or times[0] < times[1], "two LRU leaves with the same access time"
            victim = min(leaves, key=self.times.__getitem__)
            del self.ref[victim]
            del self.times[victim]
            freed += 1
        return freed

    def expect_match(self, tokens, m, record: bool) -> None:
        p = self.P
        self.clock += 1
        k = 0
        while (k + 1) * p <= len(tokens) and tuple(tokens[: (k + 1) * p]) in self.ref:
            k += 1
        prefixes = [tuple(tokens[: i * p]) for i in range(1, k + 1)]
        assert m.pages == [self.ref[key] for key in prefixes], (m.pages, tokens)
        assert m.num_tokens == k * p
        for key in prefixes:
            self.times[key] = self.clock
        best = 0
        if p > 1 and k * p < len(tokens):
            head, want = tuple(tokens[: k * p]), tokens[k * p : k * p + p]
            for key in self.ref:
                if len(key) == (k + 1) * p and key[: k * p] == head:
                    page = key[k * p :]
                    c = 0
                    while c < len(want) and page[c] == want[c]:
                        c += 1
                    best = max(best, c)
        assert m.partial_tokens == best, (m.partial_tokens, best, tokens)
        if best:
            owner = [key for key, page in self.ref.items() if page == m.partial_page]
            assert len(owner) == 1 and owner[0][: k * p] == tuple(tokens[: k * p])
            assert list(owner[0][k * p : k * p + best]) == list(tokens[k * p : k * p + best])
        else:
            assert m.partial_page is None
        if record:
            self.hit += k * p
            self.miss += len(tokens) - k * p

    # ------------------------------------------------------------------ request helpers
    def pick(self, index: int) -> tuple[int, Req]:
        rid = sorted(self.reqs)[index % len(self.reqs)]
        return rid, self.reqs[rid]

    def release(self, req: Req) -> None:
        self.cache.unlock(req.node)
        self.locks[req.lock_key] -= 1
        if not self.locks[req.lock_key]:
            del self.locks[req.lock_key]
        self.pool.decref(sorted(req.private))
        req.private.clear()

    def grow(self, req: Req) -> bool:
        """Allocate pages for all of req.tokens (evicting as needed) and write their KV; False if it cannot."""
        need = -(-len(req.tokens) // self.P) - len(req.table)
        short = need - self.pool.num_free
        if short > 0:
            event("evicted to make room")
            freed = self.cache.evict(short)
            assert freed == self.model_evict(short)
        if need > self.pool.num_free:
            event("request does not fit")
            return False
        pages = self.pool.alloc(need)
        req.table.extend(pages)
        req.private.update(pages)
        k, v = kv_of(req.tokens)
        for pos in range(req.computed, len(req.tokens)):
            page, slot = req.table[pos // self.P], pos % self.P
            self.k[page, slot] = k[pos]
            self.v[page, slot] = v[pos]
        req.computed = len(req.tokens)
        return True

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.reqs) < MAX_REQUESTS)
    @rule(data=st.data())
    def start(self, data) -> None:
        tokens = data.draw(self.token_lists(min_size=1))
        probe = tokens[:-1]
        m = self.cache.match_prefix(probe)
        self.expect_match(probe, m, record=True)
        self.cache.lock(m.node)
        lock_key = tuple(probe[: m.num_tokens])
        self.locks[lock_key] += 1
        req = Req(list(tokens), list(m.pages), m.node, lock_key, set(), m.num_tokens)
        if m.partial_tokens:
            source_path = lock_key + m.partial_node.key
            was_full = self.pool.num_free == 0
            event("partial page reused with the pool full" if was_full else "partial page reused")
            out = self.cache.reuse_partial(m)
            if was_full:
                self.model_evict(1, extra_paths=[source_path])
            if out is None:
                assert self.pool.num_free == 0
            else:
                page, n = out
                assert n == m.partial_tokens and page not in self.ref.values()
                assert np.array_equal(self.k[page, :n], self.k[m.partial_page, :n])
                assert np.array_equal(self.v[page, :n], self.v[m.partial_page, :n])
                req.table.append(page)
                req.private.add(page)
                req.computed += n
        if self.grow(req):
            self.reqs[self.next_rid] = req
            self.next_rid += 1
        else:
            self.release(req)

    @precondition(lambda self: self.reqs)
    @rule(index=st.integers(0, 100), keep_running=st.booleans())
    def insert(self, index: int, keep_running: bool) -> None:
        rid, req = self.pick(index)
        p = self.P
        n_pages = len(req.tokens) // p
        mine = req.table[:n_pages]
        r = self.cache.insert(req.tokens[: n_pages * p], mine)
        self.clock += 1
        tree, dups = [], []
        for i in range(1, n_pages + 1):
            key = tuple(req.tokens[: i * p])
            page = mine[i - 1]
            if key in self.ref:
                tree.append(self.ref[key])
                if self.ref[key] != page:
                    dups.append(page)
            else:
                self.ref[key] = page
                tree.append(page)
            self.times[key] = self.clock
        assert r.tree_pages == tree and r.duplicates == dups
        if dups:
            event("insert with duplicates")
        assert set(dups) <= req.private, "a duplicate the request does not own"
        req.table[:n_pages] = r.tree_pages
        req.private -= set(r.tree_pages) | set(dups)
        self.pool.decref(dups)
        if keep_running:
            self.cache.lock(r.node)
            new_key = tuple(req.tokens[: n_pages * p])
            self.locks[new_key] += 1
            self.cache.unlock(req.node)
            self.locks[req.lock_key] -= 1
            if not self.locks[req.lock_key]:
                del self.locks[req.lock_key]
            req.node, req.lock_key = r.node, new_key
        else:
            self.release(req)
            del self.reqs[rid]

    @precondition(lambda self: self.reqs)
    @rule(index=st.integers(0, 100), data=st.data())
    def extend(self, index: int, data) -> None:
        rid, req = self.pick(index)
        req.tokens += data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=self.P + 1))
        if not self.grow(req):
            self.release(req)
            del self.reqs[rid]

    @precondition(lambda self: self.reqs)
    @rule(index=st.integers(0, 100))
    def abort(self, index: int) -> None:
        rid, req = self.pick(index)
        self.release(req)
        del self.reqs[rid]

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        assert self.cache.evict(n) == self.model_evict(n)

    @rule(data=st.data())
    def lookahead(self, data) -> None:
        tokens = data.draw(self.token_lists(min_size=0))
        m = self.cache.match_prefix(tokens, record=False)
        self.expect_match(tokens, m, record=False)

    @precondition(lambda self: not self.reqs)
    @rule()
    def flush(self) -> None:
        self.cache.reset()
        self.ref.clear()
        self.times.clear()

    def token_lists(self, min_size: int):
        p = self.P
        rng = random.Random(p)
        bases = [[rng.randrange(VOCAB) for _ in range(3 * p + 2)] for _ in range(3)]
        base = st.sampled_from(bases)
        return st.builds(
            lambda b, cut, tail: (b[:cut] + tail) or [0] * min_size,
            base,
            st.integers(0, 3 * p + 2),
            st.lists(st.integers(0, VOCAB - 1), max_size=p + 2),
        )

    # ------------------------------------------------------------------ invariants
    @invariant()
    def tree_matches_model(self) -> None:
        cache = self.cache
        cache.check(request_private_pages=[page for req in self.reqs.values() for page in req.private])
        assert cache.snapshot() == self.ref
        assert cache._clock == self.clock
        protected = self.protected()
        assert protected <= set(self.ref), "a locked path lost its pages"
        assert cache.protected_pages == len(protected)
        assert cache.evictable_pages == len(self.ref) - len(protected)
        assert cache.cached_pages == len(self.ref)
        assert (cache.stats.hit_tokens, cache.stats.miss_tokens) == (self.hit, self.miss)

    @invariant()
    def every_page_holds_its_tokens_kv(self) -> None:
        p = self.P
        for key, page in self.ref.items():
            k, v = kv_of(key)
            assert np.array_equal(self.k[page], k[-p:]) and np.array_equal(self.v[page], v[-p:]), key
        for req in self.reqs.values():
            k, v = kv_of(req.tokens)
            for pos in range(req.computed):
                page, slot = req.table[pos // p], pos % p
                assert self.pool.ref_counts[page] == 1, "a request reads a freed page"
                assert np.array_equal(self.k[page, slot], k[pos]) and np.array_equal(self.v[page, slot], v[pos])

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.release(self.reqs.pop(rid))
        self.cache.reset()
        self.cache.check()
        assert self.pool.num_free == NUM_PAGES, "leaked pages"


SETTINGS = settings(
    max_examples=30,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def machine_test(page_size: int):
    case = type(f"RadixMachineP{page_size}", (RadixMachine,), {"PAGE_SIZE": page_size}).TestCase
    case.settings = SETTINGS
    return case


TestRadixP1 = machine_test(1)
TestRadixP2 = machine_test(2)
TestRadixP4 = machine_test(4)
TestRadixP16 = machine_test(16)
