"""Unit tests of the radix prefix cache: the edge cases SGLang users hit, on a real (tiny) page pool."""

import pytest
import torch

from radixrt.memory.page_pool import KVLayout, OutOfPagesError, PagePool
from radixrt.memory.radix_cache import RadixCache


def make(num_pages: int = 64, page_size: int = 4, **kwargs) -> tuple[PagePool, RadixCache]:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=2, page_size=page_size, dtype=torch.float32)
    pool = PagePool(layout, num_pages)
    return pool, RadixCache(pool, **kwargs)


def write_kv(pool: PagePool, tokens, pages, start: int = 0) -> None:
    """Write a recognisable KV entry for positions start..len(tokens): K = (token, position), V = (prefix sum, 1)."""
    size = pool.page_size
    for i in range(start, len(tokens)):
        page, slot = pages[i // size], i % size
        pool.k_caches[0][page, slot, 0] = torch.tensor([tokens[i], i], dtype=torch.float32)
        pool.v_caches[0][page, slot, 0] = torch.tensor([sum(tokens[: i + 1]), 1], dtype=torch.float32)


def cache_seq(pool: PagePool, cache: RadixCache, tokens) -> list[int]:
    """Allocate, fill and insert a whole-page sequence as a finished request would; return the tree pages."""
    pages = pool.alloc(len(tokens) // pool.page_size)
    write_kv(pool, tokens, pages)
    result = cache.insert(tokens, pages)
    pool.decref(result.duplicates)
    return result.tree_pages


def test_match_ending_mid_edge_splits_at_a_page_boundary():
    pool, cache = make(page_size=4)
    seq = list(range(100, 116))  # 4 pages in one edge
    pages = cache_seq(pool, cache, seq)
    assert cache.num_nodes == 1
    m = cache.match_prefix(seq[:8] + [999, 998])
    assert m.pages == pages[:2] and m.num_tokens == 8
    assert cache.num_nodes == 2 and m.node.key == tuple(seq[:8])
    assert m.partial_page is None and m.partial_tokens == 0  # the next page differs at its first token
    cache.check()
    # The lower half keeps working: the full sequence still matches across the split.
    assert cache.match_prefix(seq).pages == pages
    cache.check()


def test_match_ending_mid_page_offers_the_partial_page():
    pool, cache = make(page_size=4)
    seq = list(range(16))
    pages = cache_seq(pool, cache, seq)
    m = cache.match_prefix(seq[:10])  # 2 whole pages + 2 tokens of the third
    assert m.pages == pages[:2] and m.num_tokens == 8
    assert m.partial_page == pages[2] and m.partial_tokens == 2
    # Also when the query goes on but diverges inside the page.
    m2 = cache.match_prefix(seq[:11] + [77, 78, 79, 80])
    assert m2.num_tokens == 8 and m2.partial_page == pages[2] and m2.partial_tokens == 3
    cache.check()


def test_match_ending_exactly_at_a_node():
    pool, cache = make(page_size=2)
    a = [1, 2, 3, 4]
    cache_seq(pool, cache, a)
    b_pages = cache_seq(pool, cache, a + [5, 6])
    nodes = cache.num_nodes
    m = cache.match_prefix(a)
    assert m.num_tokens == 4 and m.node.key == tuple(a) and cache.num_nodes == nodes
    m = cache.match_prefix(a + [5, 6, 7])
    assert m.pages == b_pages and m.node.key == (5, 6) and m.partial_page is None
    cache.check()


def test_insert_prefix_of_existing_splits_and_reports_duplicates():
    pool, cache = make(page_size=4)
    seq = list(range(12))
    tree = cache_seq(pool, cache, seq)
    mine = pool.alloc(2)
    result = cache.insert(seq[:8], mine)
    assert result.tree_pages == tree[:2] and result.duplicates == mine
    assert result.node.key == tuple(seq[:8]) and cache.num_nodes == 2
    pool.decref(result.duplicates)
    cache.check()


def test_insert_extending_existing_keeps_tree_pages():
    pool, cache = make(page_size=4)
    seq = list(range(8))
    tree = cache_seq(pool, cache, seq)
    # A request that matched the prefix reuses the tree pages and inserts them back with its own tail.
    m = cache.match_prefix(seq + [8, 9, 10, 11])
    cache.lock(m.node)
    tail = pool.alloc(1)
    result = cache.insert(seq + [8, 9, 10, 11], m.pages + tail)
    assert result.tree_pages == tree + tail and result.duplicates == []
    cache.unlock(m.node)
    assert cache.cached_pages == 3 and cache.protected_pages == 0
    cache.check()


def test_insert_diverging_mid_page_and_mid_edge():
    pool, cache = make(page_size=4)
    a = list(range(16))
    a_pages = cache_seq(pool, cache, a)
    b = a[:6] + [50, 51] + [52, 53, 54, 55]  # diverges inside the second page
    b_pages = pool.alloc(3)
    result = cache.insert(b, b_pages)
    assert result.tree_pages == a_pages[:1] + b_pages[1:]
    assert result.duplicates == b_pages[:1]
    pool.decref(result.duplicates)
    assert cache.match_prefix(a).pages == a_pages
    assert cache.match_prefix(b).pages == a_pages[:1] + b_pages[1:]
    # The sorted first-page index finds the sibling sharing the most tokens: a's second page (3), not b's (2).
    m = cache.match_prefix(a[:7])
    assert m.num_tokens == 4 and m.partial_tokens == 3 and m.partial_page == a_pages[1]
    cache.check()


def test_duplicate_inserts():
    pool, cache = make(page_size=2)
    seq = [5, 6, 7, 8]
    tree = cache_seq(pool, cache, seq)
    again = cache.insert(seq, tree)  # the same pages: nothing duplicated
    assert again.tree_pages == tree and again.duplicates == []
    other = pool.alloc(2)
    dup = cache.insert(seq, other)
    assert dup.tree_pages == tree and dup.duplicates == other
    pool.decref(dup.duplicates)
    assert cache.cached_pages == 2 and cache.num_nodes == 1
    assert cache.stats.duplicate_pages == 2
    cache.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_empty_and_one_token_sequences(page_size):
    pool, cache = make(page_size=page_size)
    m = cache.match_prefix([])
    assert m.pages == [] and m.num_tokens == 0 and m.node is cache.root and m.partial_page is None
    r = cache.insert([], [])
    assert r.node is cache.root and r.tree_pages == [] and r.duplicates == []
    cache.lock(cache.root)  # a no-op on the root
    cache.unlock(cache.root)
    m = cache.match_prefix([7])
    assert m.num_tokens == 0
    seq = [7] * page_size
    tree = cache_seq(pool, cache, seq)
    m = cache.match_prefix([7])
    if page_size == 1:
        assert m.pages == tree and m.num_tokens == 1
    else:
        assert m.num_tokens == 0 and m.partial_page == tree[0] and m.partial_tokens == 1
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1] * (page_size + 1), pool.alloc(1))
    cache.check(request_private_pages=[p for p in range(pool.num_pages) if pool.ref_counts[p] and p not in tree])


def test_eviction_goes_lru_leaf_first_then_the_parent_after_its_last_child():
    pool, cache = make(page_size=2)
    base = [1, 2, 3, 4]
    cache_seq(pool, cache, base)
    left = cache_seq(pool, cache, base + [10, 11])
    right = cache_seq(pool, cache, base + [20, 21])
    cache.match_prefix(base + [10, 11])  # left is now more recent than right
    assert cache.evictable_pages == 4
    assert cache.evict(1) == 1  # the right leaf (LRU)
    assert cache.match_prefix(base + [20, 21]).num_tokens == 4
    assert cache.match_prefix(base + [10, 11]).pages[-1] == left[-1]
    assert right[-1] in pool._free
    assert cache.evict(1) == 1  # now only the left leaf is a leaf
    assert cache.num_nodes == 1 and cache.evictable_pages == 2
    # The parent became a leaf after its last child went; it is evicted tail page first.
    assert cache.evict(1) == 1
    assert cache.match_prefix(base).num_tokens == 2
    assert cache.evict(10) == 1 and cache.cached_pages == 0 and cache.num_nodes == 0
    assert pool.num_free == pool.num_pages and cache.stats.evicted_pages == 4
    cache.check()


def test_lru_order_follows_access_not_insertion():
    pool, cache = make(page_size=1)
    a, b, c = [1, 1], [2, 2], [3, 3]
    pa, pb, pc = (cache_seq(pool, cache, s) for s in (a, b, c))
    cache.match_prefix(a)
    cache.evict(2)
    assert pb[0] in pool._free and pb[1] in pool._free
    assert cache.match_prefix(a).pages == pa and cache.match_prefix(c).pages == pc
    cache.check()


def test_locked_paths_are_never_evicted():
    pool, cache = make(page_size=2)
    seq = [1, 2, 3, 4, 5, 6]
    tree = cache_seq(pool, cache, seq)
    other = cache_seq(pool, cache, [9, 9])
    m = cache.match_prefix(seq[:4])
    cache.lock(m.node)
    assert cache.protected_pages == 2 and cache.evictable_pages == 2
    assert cache.evict(100) == 2  # seq's third page (a leaf below the split) and the other leaf
    assert cache.match_prefix(seq).pages == tree[:2]
    assert other[0] in pool._free
    cache.unlock(m.node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(m.node)
    assert cache.evict(100) == 2 and pool.num_free == pool.num_pages
    cache.check()


def test_split_of_a_locked_node_keeps_lock_counts():
    pool, cache = make(page_size=2)
    seq = [1, 2, 3, 4, 5, 6]
    cache_seq(pool, cache, seq)
    r = cache.match_prefix(seq)
    cache.lock(r.node)
    cache.match_prefix([1, 2, 3, 4, 99])  # splits the locked node twice over
    dup = cache.insert([1, 2], pool.alloc(1))  # splits it a third time
    assert dup.tree_pages == r.pages[:1]
    pool.decref(dup.duplicates)
    assert cache.num_nodes == 3 and cache.protected_pages == 3 and cache.evictable_pages == 0
    cache.check()
    cache.unlock(r.node)
    assert cache.protected_pages == 0 and cache.evictable_pages == 3


def test_pool_smaller_than_one_request():
    pool, cache = make(num_pages=2, page_size=4)
    prompt = list(range(12))  # needs 3 pages
    m = cache.match_prefix(prompt[:-1])
    assert m.num_tokens == 0
    assert cache.evict(3) == 0  # nothing cached, nothing to free
    with pytest.raises(OutOfPagesError):
        pool.alloc(3)
    # What fits gets cached and is evicted again to make room.
    cache_seq(pool, cache, prompt[:8])
    assert pool.num_free == 0 and cache.evict(3) == 2 and pool.num_free == 2
    cache.check()


def test_partial_reuse_copies_the_page_prefix_and_counts_it():
    pool, cache = make(page_size=4)
    seq = list(range(30, 42))
    tree = cache_seq(pool, cache, seq)
    m = cache.match_prefix(seq[:7] + [0, 0])  # 1 page + 3 tokens
    cache.lock(m.node)
    page, k = cache.reuse_partial(m)
    assert k == 3 and page not in tree and pool.ref_counts[page] == 1
    for cache_t in (pool.k_caches[0], pool.v_caches[0]):
        assert torch.equal(cache_t[page, :3], cache_t[tree[1], :3])
        assert torch.count_nonzero(cache_t[page, 3:]) == 0
    assert cache.stats.partial_tokens_reused == 3
    cache.check(request_private_pages=[page])
    cache.unlock(m.node)
    pool.decref([page])
    cache.check()


def test_partial_reuse_evicts_for_its_page_but_never_the_source():
    pool, cache = make(num_pages=3, page_size=2)
    a = cache_seq(pool, cache, [1, 2, 3, 4])  # older
    b = cache_seq(pool, cache, [7, 8])  # newer
    assert pool.num_free == 0
    cache.match_prefix([7, 8])
    m = cache.match_prefix([1, 2, 3])  # a[1] is the source; the match touches a's node
    assert m.partial_page == a[1]
    # a's node is now most recent, but locked for the copy the LRU leaf b goes; a's pages stay.
    page, k = cache.reuse_partial(m)
    assert k == 1 and page == b[0] and cache.match_prefix([1, 2, 3, 4]).pages == a
    cache.check(request_private_pages=[page])
    pool.decref([page])
    # With nothing else evictable, the source is kept and reuse declines.
    c = cache.match_prefix([1, 2, 3])
    pool.alloc(1)
    assert cache.reuse_partial(c) is None and cache.match_prefix([1, 2, 3, 4]).pages == a


def test_partial_reuse_declines_a_stale_match():
    pool, cache = make(page_size=2)
    cache_seq(pool, cache, [1, 2])
    m = cache.match_prefix([1])
    cache.evict(1)
    assert cache.reuse_partial(m) is None
    cache.check()


def test_partial_reuse_off():
    pool, cache = make(page_size=4, partial_page_reuse=False)
    seq = list(range(8))
    cache_seq(pool, cache, seq)
    m = cache.match_prefix(seq[:6])
    assert m.num_tokens == 4 and m.partial_page is None and m.partial_tokens == 0
    assert cache.reuse_partial(m) is None and cache.stats.partial_tokens_reused == 0


def test_disabled_cache_keeps_nothing():
    pool, cache = make(page_size=2, disabled=True)
    pages = pool.alloc(2)
    r = cache.insert([1, 2, 3, 4], pages)
    assert r.node is cache.root and r.tree_pages == [] and r.duplicates == []
    m = cache.match_prefix([1, 2, 3])
    assert m.pages == [] and m.num_tokens == 0 and m.node is cache.root and m.partial_page is None
    assert cache.reuse_partial(m) is None and cache.evict(5) == 0 and cache.cached_pages == 0
    assert cache.stats.hit_tokens == 0 and cache.stats.miss_tokens == 3
    cache.check(request_private_pages=pages)
    pool.decref(pages)
    cache.check()


def test_stats_and_lookahead_matches():
    pool, cache = make(page_size=2)
    cache_seq(pool, cache, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 3, 4, 5, 6], record=False)
    assert cache.stats.hit_tokens == 0 and cache.stats.miss_tokens == 0
    cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.match_prefix([1, 2, 9])
    assert cache.stats.hit_tokens == 6 and cache.stats.miss_tokens == 3
    assert cache.stats.hit_rate == pytest.approx(6 / 9)
    assert cache.stats.as_dict()["inserted_pages"] == 2


def test_reset_flushes_and_refuses_while_locked():
    pool, cache = make(page_size=2)
    cache_seq(pool, cache, [1, 2, 3, 4])
    cache_seq(pool, cache, [1, 2, 5, 6])
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert pool.num_free == pool.num_pages and cache.cached_pages == 0 and cache.num_nodes == 0
    with pytest.raises(RuntimeError, match="evicted node"):
        cache.lock(m.node)
    cache.check()
    cache_seq(pool, cache, [1, 2])
    assert cache.match_prefix([1, 2]).num_tokens == 2


def test_check_catches_leaks_and_double_ownership():
    pool, cache = make(page_size=2)
    tree = cache_seq(pool, cache, [1, 2, 3, 4])
    leaked = pool.alloc(1)
    with pytest.raises(AssertionError, match="leaked"):
        cache.check()
    cache.check(request_private_pages=leaked)
    with pytest.raises(AssertionError, match="both in the tree and private"):
        cache.check(request_private_pages=leaked + tree[:1])
    pool.incref(tree[:1])
    with pytest.raises(AssertionError, match="refcount != 1"):
        cache.check(request_private_pages=leaked)
    pool.decref(tree[:1])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="evictable counter"):
        cache.check(request_private_pages=leaked)


def test_deep_sequences_match_past_the_chunked_compare():
    pool, cache = make(num_pages=1024, page_size=16)
    seq = [i % 251 for i in range(3000)]
    tree = cache_seq(pool, cache, seq[:2992])
    probe = seq[:1000] + [9999] + seq[1001:2992]
    m = cache.match_prefix(probe)
    assert m.num_tokens == 992 and m.pages == tree[:62] and m.partial_tokens == 8
    cache.check()


def test_record_counts_an_admission_once():
    pool, cache = make(page_size=2)
    cache_seq(pool, cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5], record=False)
    cache.record(m.num_tokens, 5)
    assert (cache.stats.hit_tokens, cache.stats.miss_tokens) == (4, 1)


def test_lru_heap_stays_bounded_under_repeated_hits():
    pool, cache = make(page_size=2)
    cache_seq(pool, cache, [1, 2])
    old = cache_seq(pool, cache, [3, 4])
    for _ in range(500):  # every hit of a leaf pushes a fresh heap entry; stale ones are compacted away
        m = cache.match_prefix([1, 2, 9])
        cache.lock(m.node)
        cache.unlock(m.node)
    assert len(cache._heap) <= 2 * cache.num_nodes + 64 + 1
    cache.check()
    assert cache.evict(1) == 1 and old[0] in pool._free
    assert cache.match_prefix([1, 2]).num_tokens == 2
