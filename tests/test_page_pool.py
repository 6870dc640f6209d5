import pytest
import torch

from radixrt.memory.page_pool import KVLayout, OutOfPagesError, PagePool


def make_pool(num_pages: int = 8, page_size: int = 4) -> PagePool:
    return PagePool(KVLayout(num_layers=2, kv_heads=1, head_dim=2, page_size=page_size, dtype=torch.float32), num_pages)


def test_alloc_free_roundtrip():
    pool = make_pool()
    pages = pool.alloc(3)
    assert len(set(pages)) == 3 and pool.num_used == 3 and pool.num_free == 5
    assert pool.decref(pages) == pages
    assert pool.num_free == 8 and pool.num_used == 0


def test_shared_page_freed_only_at_zero():
    pool = make_pool()
    (page,) = pool.alloc(1)
    pool.incref([page])
    assert pool.decref([page]) == []
    assert pool.num_used == 1
    assert pool.decref([page]) == [page]
    assert pool.num_used == 0


def test_errors_are_clear():
    pool = make_pool(num_pages=2)
    with pytest.raises(OutOfPagesError, match="asked for 3 pages, 2 free"):
        pool.alloc(3)
    (page,) = pool.alloc(1)
    pool.decref([page])
    with pytest.raises(RuntimeError, match="decref of a free page"):
        pool.decref([page])
    with pytest.raises(RuntimeError, match="incref of a free page"):
        pool.incref([page])
    assert pool.num_free == 2


def test_budget_sizing_and_page_size_one():
    layout = KVLayout(num_layers=30, kv_heads=3, head_dim=64, page_size=1, dtype=torch.bfloat16)
    assert layout.bytes_per_page == 2 * 30 * 3 * 64 * 2
    pool = PagePool.from_memory_budget(layout, memory_gb=0.001)
    assert pool.num_pages == int(0.001 * 1024**3 // layout.bytes_per_page)
    assert pool.k_caches[0].shape == (pool.num_pages, 1, 3, 64)
    with pytest.raises(ValueError, match="holds no page"):
        PagePool.from_memory_budget(layout, memory_gb=1e-9)


def test_slots_and_copy_page_prefix():
    pool = make_pool(page_size=4)
    pages = pool.alloc(2)
    assert pool.slots(pages, 6).tolist() == [pages[0] * 4 + i for i in range(4)] + [pages[1] * 4, pages[1] * 4 + 1]
    pool.k_caches[0][pages[0]] = torch.arange(8, dtype=torch.float32).view(4, 1, 2)
    pool.copy_page_prefix(pages[0], pages[1], 3)
    assert torch.equal(pool.k_caches[0][pages[1], :3], pool.k_caches[0][pages[0], :3])
    assert torch.equal(pool.k_caches[0][pages[1], 3], torch.zeros(1, 2))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_default_budget_is_a_share_of_available_memory(monkeypatch):
    from radixrt.memory import page_pool

    monkeypatch.setattr(page_pool, "available_memory_bytes", lambda: 10 * 1024**3)
    layout = KVLayout(num_layers=2, kv_heads=1, head_dim=2, page_size=4, dtype=torch.float32)
    pool = PagePool.from_memory_budget(layout, None)
    assert pool.num_pages == int(10 * 1024**3 * page_pool.CPU_SHARE_OF_AVAILABLE) // layout.bytes_per_page
    assert PagePool.from_memory_budget(layout, 0.001).num_pages == int(0.001 * 1024**3) // layout.bytes_per_page


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads Linux's /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_pool_is_zero_and_takes_memory_only_where_written(dtype):
    layout = KVLayout(num_layers=4, kv_heads=2, head_dim=64, page_size=16, dtype=dtype)
    before = _resident_bytes()
    pool = PagePool.from_memory_budget(layout, 2.0)  # 2 GB of address space
    assert _resident_bytes() - before < 64 << 20
    for cache in (pool.k_caches[0], pool.v_caches[-1]):
        assert cache.dtype == dtype and cache.shape == (pool.num_pages, 16, 2, 64)
        assert not cache[:: max(1, pool.num_pages // 50)].any()
    pool.k_caches[1][3].fill_(1.0)
    assert pool.k_caches[1][3].all() and not pool.k_caches[1][2].any() and not pool.v_caches[1][3].any()
