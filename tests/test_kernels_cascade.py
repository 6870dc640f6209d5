"""Cascade attention: a shared prefix read once per group must give plain paged decode's and extend's result."""

import pytest
import torch

from radixrt.kernels import cpu_kernels, torch_cascade, torch_ref

# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = pytest.mark.serial

SCALE = 8**-0.5


def shared_case(page_size: int, layout: list[tuple[int, int]], dtype=torch.float32, seed: int = 0):
    """``layout``: per request (shared-prefix id or -1, own tokens). Prefix ``i`` has ``i + 2`` full pages."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim, heads = 2, 8, 6
    next_page = [1]

    def take(n):
        ids = list(range(next_page[0], next_page[0] + n))
        next_page[0] += n
        return ids

    prefixes = {}
    rows, lens = [], []
    for prefix, own in layout:
        if prefix >= 0 and prefix not in prefixes:
            prefixes[prefix] = take(prefix + 2)
        shared = prefixes.get(prefix, [])
        rows.append(shared + take(-(-own // page_size)))
        lens.append(len(shared) * page_size + own)
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    perm = torch.randperm(next_page[0], generator=gen).int()  # scatter pages over the pool
    table = torch.where(table > 0, perm[table.long()] + 1, 0).int()
    k_cache = torch.randn(next_page[0] + 1, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(next_page[0] + 1, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(layout), heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


LAYOUTS = {
    "one group and loners": [(0, 5), (-1, 9), (0, 1), (0, 16), (-1, 3), (0, 7)],
    "two groups": [(1, 4), (0, 2), (1, 1), (0, 11), (1, 17)],
    "pair, own part one token": [(2, 1), (2, 1)],
}


@pytest.mark.parametrize("path", ["kernel where built", "torch"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cascade_equals_paged_decode(page_size, layout, path, monkeypatch):
    if path == "torch":  # gathers, SDPA and the log-sum-exp merge instead of the C++ kernel
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    q, k_cache, v_cache, table, lens = shared_case(page_size, LAYOUTS[layout])
    plan = torch_cascade.plan_decode(table, lens, page_size)
    assert plan.groups, "the layout shares pages, so the plan must use them"
    out = torch_cascade.cascade_decode_attention(q, k_cache, v_cache, plan, SCALE)
    expected = torch_ref.decode_attention(q, k_cache, v_cache, table, lens, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_bf16_within_tolerance():
    q, k_cache, v_cache, table, lens = shared_case(4, LAYOUTS["two groups"], dtype=torch.bfloat16)
    plan = torch_cascade.plan_decode(table, lens, 4)
    out = torch_cascade.cascade_decode_attention(q, k_cache, v_cache, plan, SCALE)
    assert out.dtype == torch.bfloat16
    expected = torch_ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, SCALE)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_plan_finds_groups_and_their_shared_pages():
    q, k_cache, v_cache, table, lens = shared_case(4, LAYOUTS["two groups"])
    plan = torch_cascade.plan_decode(table, lens, 4)
    found = sorted((r.rows.tolist(), len(r.pages)) for r in plan.groups)
    assert found == [([0, 2, 4], 3), ([1, 3], 2)]
    for group in plan.groups:
        assert torch.equal(group.pages, table[group.rows[0], : len(group.pages)].long())
    # each request keeps its own pages only, and its mask covers exactly its own tokens
    assert plan.allowed.sum(-1).flatten().tolist() == [4, 2, 1, 11, 17]


def test_no_groups_when_nothing_is_shared_or_only_the_current_page_is():
    _, _, _, table, lens = shared_case(4, [(-1, 5), (-1, 9), (-1, 2)])
    assert torch_cascade.plan_decode(table, lens, 4).groups == []
    # two requests on the same single page (n samples right after prefill): the current page is never shared
    same = torch.tensor([[3], [3]], dtype=torch.int32)
    assert torch_cascade.plan_decode(same, torch.tensor([2, 2]), 4).groups == []


def test_groups_are_capped_by_pages_saved():
    layout = [(i, 1) for i in range(torch_cascade.MAX_GROUPS + 2) for _ in range(2)]
    _, _, _, table, lens = shared_case(2, layout)
    plan = torch_cascade.plan_decode(table, lens, 2)
    assert len(plan.groups) == torch_cascade.MAX_GROUPS
    assert min(len(g.pages) for g in plan.groups) == 4  # prefixes 0 and 1 (2 and 3 pages) saved the least


def test_shared_run_stops_at_the_first_difference():
    table = torch.tensor([[1, 2, 3, 4, 9], [1, 5, 3, 4, 10]], dtype=torch.int32)
    plan = torch_cascade.plan_decode(table, torch.tensor([9, 9]), 2)
    assert [g.pages.tolist() for g in plan.groups] == [[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_attend_matches_unfused(dtype):
    """The CPU path calls the flash kernel for its log-sum-exp; other devices compute it by hand."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, n, 8, generator=gen).to(dtype) for n in (5, 11, 11))
    allowed = torch.rand(3, 1, 1, 11, generator=gen) > 0.3
    allowed[..., 0] = True
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    out, lse = torch_cascade._attend(q, k, v, SCALE, bias)
    ref_out, ref_lse = torch_cascade._attend_unfused(q.float(), k.float(), v.float(), SCALE, bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)


def extend_case(page_size: int, layout: list[tuple[int, int, int]], dtype=torch.float32, seed: int = 0):
    """``layout``: per request (shared-prefix id or -1, cached tokens after that prefix, new tokens)."""
    _, k_cache, v_cache, table, lens = shared_case(
        page_size, [(prefix, own + new) for prefix, own, new in layout], dtype, seed)
    extend = torch.tensor([new for _, _, new in layout], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(int(extend.sum()), 6, 8, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, lens - extend, extend


EXTEND_LAYOUTS = {
    "one group and loners": [(0, 3, 5), (-1, 0, 9), (0, 0, 4), (-1, 6, 2), (0, 17, 1)],
    "two groups": [(1, 2, 4), (0, 5, 2), (1, 0, 7), (0, 0, 3), (1, 9, 1)],
    "question burst": [(2, 0, 6)] * 5,
}


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", list(EXTEND_LAYOUTS))
def test_cascade_extend_equals_extend_attention(page_size, layout):
    q, k_cache, v_cache, table, prefix, extend = extend_case(page_size, EXTEND_LAYOUTS[layout])
    plan = torch_cascade.plan_extend(table, prefix, extend, page_size)
    assert plan.groups, "the layout shares cached pages, so the plan must use them"
    out = torch_cascade.cascade_extend_attention(q, k_cache, v_cache, table, prefix, extend, plan, SCALE, {})
    expected = torch_ref.extend_attention(q, k_cache, v_cache, table, prefix, extend, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_cascade_extend_bf16_within_tolerance():
    q, k_cache, v_cache, table, prefix, extend = extend_case(4, EXTEND_LAYOUTS["two groups"], torch.bfloat16)
    plan = torch_cascade.plan_extend(table, prefix, extend, 4)
    out = torch_cascade.cascade_extend_attention(q, k_cache, v_cache, table, prefix, extend, plan, SCALE)
    assert out.dtype == torch.bfloat16
    expected = torch_ref.extend_attention(q.float(), k_cache.float(), v_cache.float(), table, prefix, extend, SCALE)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_extend_plan_shares_only_pages_wholly_inside_every_cached_prefix():
    q, k_cache, v_cache, table, prefix, extend = extend_case(4, EXTEND_LAYOUTS["one group and loners"])
    plan = torch_cascade.plan_extend(table, prefix, extend, 4)
    assert [(g.rows.tolist(), len(g.pages)) for g in plan.groups] == [([0, 2, 4], 2)]
    assert plan.shift == [2, 0, 2, 0, 2]
    assert plan.alone.tolist() == [1, 3]
    assert plan.alone_tokens.tolist() == list(range(5, 14)) + [18, 19]
    # a member whose cached prefix ends inside the second shared page limits the group to the first
    table2 = torch.tensor([[1, 2, 7], [1, 2, 8]], dtype=torch.int32)
    plan2 = torch_cascade.plan_extend(table2, torch.tensor([8, 6]), torch.tensor([3, 3]), 4)
    assert [g.pages.tolist() for g in plan2.groups] == [[1]]
    # nothing cached: nothing to share
    assert torch_cascade.plan_extend(table2, torch.tensor([0, 0]), torch.tensor([3, 3]), 4).groups == []


def test_shared_pages_are_cut_to_whole_spans_of_the_bf16_walk():
    table = torch.tensor([list(range(1, 12)) + [20, 21], list(range(1, 12)) + [30, 0]], dtype=torch.int32)
    lens = torch.tensor([12 * 4 + 1, 11 * 4 + 2], dtype=torch.int32)
    assert [len(g.pages) for g in torch_cascade.plan_decode(table, lens, 4).groups] == [11]
    assert [len(g.pages) for g in torch_cascade.plan_decode(table, lens, 4, align_pages=8).groups] == [8]
    short = torch.tensor([[1, 2, 3, 4, 5, 20], [1, 2, 3, 4, 5, 30]], dtype=torch.int32)
    assert torch_cascade.plan_decode(short, torch.tensor([22, 22]), 4, align_pages=8).groups == []
    q = torch.zeros(1, 6, 64, dtype=torch.bfloat16)
    spans = cpu_kernels.bf16_dot_built()
    for page_size, pages in ((16, 8), (32, 4), (64, 2), (128, 1), (24, 4), (1, 8), (4, 8)):
        k_cache = torch.zeros(2, page_size, 2, 64, dtype=torch.bfloat16)
        assert torch_cascade.shared_alignment(q, k_cache) == (pages if spans else 1), page_size
    assert torch_cascade.shared_alignment(q.float(), torch.zeros(2, 16, 2, 64)) == 1
    assert torch_cascade.shared_alignment(q[..., :48], torch.zeros(2, 16, 2, 48, dtype=torch.bfloat16)) == 1


@pytest.mark.parametrize("items_per_thread", [1, 2, 4, 8])  # chunks of 5, 4, 2 and 1 requests (2 threads)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
def test_a_query_row_gets_the_same_bits_alone_or_after_a_shared_prefix(dtype, page_size, items_per_thread,
                                                                       monkeypatch):
    """A verify step's rows of one request, and requests with a common prompt, share their leading pages; planned
    as the runtime plans them, each row's output equals the row attending alone bit for bit, so speculation and
    the batch a request decodes in change no token (bf16 included: the shared part ends where a span of the bf16
    walk ends, so every row meets the same softmax steps), and however the group's rows fall into the kernel's
    chunks and row tiles (a chunk of 2 requests is 6 query rows: tiles of 4 and 2)."""
    monkeypatch.setattr(torch_cascade, "ITEMS_PER_THREAD", items_per_thread)
    for seed in range(6):  # a rounding difference shows in a few elements only: several cases
        _one_row_alone_or_shared(dtype, page_size, seed)


def _one_row_alone_or_shared(dtype, page_size: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(page_size * 100 + seed)
    kv_heads, heads, head_dim, shared = 3, 9, 64, 11
    pages = torch.randperm(40, generator=gen)[:shared + 4].int() + 1
    prefix = pages[:shared].tolist()
    rows = [prefix + [int(pages[shared])]] * 4 + [prefix + pages[shared + 1:].tolist()]  # 4 verify rows, 1 other
    lens = [shared * page_size + 3 + i for i in range(4)] + [(shared + 2) * page_size + 5]
    width = max(map(len, rows))
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    lens = torch.tensor(lens, dtype=torch.int32)
    k_cache = torch.randn(41, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(41, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    # scores that grow along the context: each span raises the running maximum, so every rescale counts
    ramp = torch.zeros(41, 1, 1, 1)
    ramp[torch.tensor(rows[-1]).long(), 0, 0, 0] = torch.linspace(0.2, 1.5, len(rows[-1]))
    k_cache = (k_cache.float() * ramp + 0.5).to(dtype)
    q = (torch.randn(len(rows), heads, head_dim, generator=gen) * 0.3 + 0.5).to(dtype)
    plan = torch_cascade.plan_decode(table, lens, page_size,
                                     align_pages=torch_cascade.shared_alignment(q, k_cache))
    assert plan.groups, "the rows share their leading pages"
    together = torch_cascade.cascade_decode_attention(q, k_cache, v_cache, plan, SCALE)
    # the fp32 log-sum-exp shows a difference in rounding that the bf16 output may round away
    _, together_lse = cpu_kernels.paged_decode(q, k_cache, v_cache, plan.own_table, plan.own_lens, SCALE, 0,
                                               plan.kernel_chunks(kv_heads))
    for r in range(len(rows)):
        alone, alone_lse = cpu_kernels.paged_decode(q[r : r + 1], k_cache, v_cache, table[r : r + 1], lens[r : r + 1],
                                                    SCALE)
        assert torch.equal(together[r], alone[0]) and torch.equal(together_lse[r], alone_lse[0]), (seed, r)
