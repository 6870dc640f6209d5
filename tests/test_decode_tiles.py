"""The decode kernel's bf16 products on AMX tiles, and requests that read the same pages walked together.

On a CPU with AMX the kernel multiplies a tile of up to 16 query rows at once, so the rows of a speculative verify
step (each a decode row of its request, over the request's pages up to its own length) are walked together in one
chunk. A row must get the same bits whichever way it is walked: alone, as a decode row, or with its request's
other rows; the plan must keep those rows together only where the kernel walks them so.
"""

import pytest
import torch

from radixrt.kernels import cpu_kernels, torch_cascade, torch_ref

# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = [pytest.mark.usefixtures("cpu_kernel_module"), pytest.mark.serial]

BF16_OUT = dict(atol=2e-2, rtol=2e-2)


def tiles_here() -> bool:
    return cpu_kernels.decode_tiles_usable()


def verify_rows_case(requests: int, rows: int, context: int, page_size: int, head_dim: int, heads: int = 9,
                     kv_heads: int = 3, seed: int = 0):
    """``requests`` requests of ``context`` tokens, each with ``rows`` decode rows over its pages (row i sees
    ``context + i + 1`` keys), in request order: (q, k, v, table, lens)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-(context + rows) // page_size)
    num_pages = requests * width + 1
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).bfloat16()
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).view(requests, width).int()
    table = pages.repeat_interleave(rows, dim=0).contiguous()
    lens = torch.tensor([context + i + 1 for _ in range(requests) for i in range(rows)], dtype=torch.int32)
    q = torch.randn(requests * rows, heads, head_dim, generator=gen).bfloat16()
    return q, k, v, table, lens


def together(requests: int, rows: int) -> cpu_kernels.CascadeChunks:
    """Each request's rows as one chunk, nothing shared."""
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)
    return cpu_kernels.CascadeChunks(rows=as_int(range(requests * rows)),
                                     offsets=as_int(range(0, requests * rows + 1, rows)),
                                     groups=as_int([-1] * requests), shared_table=as_int([[0]]),
                                     shared_pages=as_int([0]))


def test_tiles_are_used_where_the_cpu_has_amx():
    has_amx = "amx_bf16" in cpu_kernels.cpu_flags() and cpu_kernels.bf16_dot_built()
    assert tiles_here() == (has_amx and cpu_kernels.load().linear_amx_usable())


@pytest.mark.parametrize("tiles", [True, False])  # False: the vdpbf16ps (or portable) walk, one request at a time
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (64, 4), (128, 16), (32, 1), (64, 32)])
@pytest.mark.parametrize("rows", [1, 5, 9])  # 9 rows x 3 query heads: two tiles of rows
def test_a_requests_rows_walked_together_get_the_bits_each_gets_alone(tiles, head_dim, page_size, rows):
    if tiles and not tiles_here():
        pytest.skip("no AMX tiles on this CPU: the walk together runs only on them")
    q, k, v, table, lens = verify_rows_case(3, rows, 150, page_size, head_dim, seed=head_dim + page_size + rows)
    scale = head_dim**-0.5
    alone, alone_lse = cpu_kernels.paged_decode(q, k, v, table, lens, scale, tiles=tiles)
    joint, joint_lse = cpu_kernels.paged_decode(q, k, v, table, lens, scale, 0, together(3, rows), tiles=tiles)
    assert torch.equal(joint, alone) and torch.equal(joint_lse, alone_lse)
    ref = torch_ref.decode_attention(q.float(), k.float(), v.float(), table, lens, scale)
    torch.testing.assert_close(alone.float(), ref, **BF16_OUT)


@pytest.mark.parametrize("context", [1, 127, 128, 129, 300])  # within a span, on its edge, past it, several spans
def test_tiles_match_the_fp32_reference_across_spans(context):
    if not tiles_here():
        pytest.skip("no AMX tiles on this CPU")
    q, k, v, table, lens = verify_rows_case(2, 4, context, 16, 64, seed=context)
    out, lse = cpu_kernels.paged_decode(q, k, v, table, lens, 0.125, 0, together(2, 4))
    ref = torch_ref.decode_attention(q.float(), k.float(), v.float(), table, lens, 0.125)
    torch.testing.assert_close(out.float(), ref, **BF16_OUT)
    ref_lse = torch.stack([
        torch.logsumexp(torch.einsum("hd,nhd->hn", q[r].float(), torch_ref.gather_pages(k, table[r].long())
                                     .view(-1, 3, 64)[: int(lens[r])].float().repeat_interleave(3, dim=1)) * 0.125,
                        dim=-1) for r in range(q.shape[0])])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_a_shared_prefix_then_rows_walked_together():
    """Two requests after the same prefix pages (a cascade group), each with three rows: the group's chunk walks the
    prefix for all six, then each request's rows together over their own pages, with the bits of each alone."""
    if not tiles_here():
        pytest.skip("no AMX tiles on this CPU")
    gen = torch.Generator().manual_seed(7)
    page_size, shared_pages = 16, 8
    k = torch.randn(40, page_size, 3, 64, generator=gen).bfloat16()
    v = torch.randn(40, page_size, 3, 64, generator=gen).bfloat16()
    own = [[20, 21, 22], [30, 31, 32]]
    table = torch.tensor([own[r // 3] for r in range(6)], dtype=torch.int32)  # each row's pages after the prefix
    lens = torch.tensor([35 + r % 3 for r in range(6)], dtype=torch.int32)
    q = torch.randn(6, 9, 64, generator=gen).bfloat16()
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)
    prefix = list(range(1, 1 + shared_pages))
    chunks = cpu_kernels.CascadeChunks(rows=as_int(range(6)), offsets=as_int([0, 6]), groups=as_int([0]),
                                       shared_table=as_int([prefix]), shared_pages=as_int([shared_pages]))
    out, _ = cpu_kernels.paged_decode(q, k, v, table, lens, 0.125, 0, chunks)
    full = torch.tensor([prefix + own[r // 3] for r in range(6)], dtype=torch.int32)
    full_lens = lens + shared_pages * page_size
    single = cpu_kernels.CascadeChunks(rows=as_int([0]), offsets=as_int([0, 1]), groups=as_int([0]),
                                       shared_table=as_int([prefix]), shared_pages=as_int([shared_pages]))
    for r in range(6):  # each row alone after the same prefix
        alone, _ = cpu_kernels.paged_decode(q[r : r + 1], k, v, table[r : r + 1], lens[r : r + 1], 0.125, 0, single)
        assert torch.equal(out[r : r + 1], alone)
    ref = torch_ref.decode_attention(q.float(), k.float(), v.float(), full, full_lens, 0.125)
    torch.testing.assert_close(out.float(), ref, **BF16_OUT)


def test_the_plan_keeps_rows_that_read_the_same_pages_together():
    q, _, _, table, lens = verify_rows_case(3, 4, 40, 16, 64)
    plan = torch_cascade.plan_decode(table, lens, 16, align_pages=8)  # 3 pages each: no shared span of 8 pages
    assert plan.kernel_chunks(3, joint=False) is None  # nothing shared: the plain walk, a request at a time
    chunks = plan.kernel_chunks(3, joint=True)
    assert chunks.offsets.tolist() == [0, 4, 8, 12] and chunks.groups.tolist() == [-1, -1, -1]
    assert chunks.rows.tolist() == list(range(12))
    decode = torch_cascade.plan_decode(table[::4].contiguous(), lens[::4].contiguous(), 16, align_pages=8)
    assert decode.kernel_chunks(3, joint=True) is None  # a decode step's requests each read their own pages


def test_one_requests_rows_are_cut_to_keep_every_thread_busy(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _, _, _, table, lens = verify_rows_case(1, 9, 40, 16, 64)
    chunks = torch_cascade.plan_decode(table, lens, 16, align_pages=8).kernel_chunks(3, joint=True)
    sizes = (chunks.offsets[1:] - chunks.offsets[:-1]).tolist()
    assert sizes == [5, 4]  # 2 chunks x 3 kv heads: the 6 items 2 threads want, not 3


def test_the_decode_backend_walks_a_verify_steps_rows_together(monkeypatch):
    """Through the model's attention: the cascade plan hands the kernel each request's rows as one chunk on AMX."""
    q, k, v, table, lens = verify_rows_case(2, 3, 60, 16, 64)
    seen = []
    real = cpu_kernels.paged_decode
    monkeypatch.setattr(cpu_kernels, "paged_decode", lambda *a, **kw: seen.append(a[7]) or real(*a, **kw))
    plan = torch_cascade.plan_decode(table, lens, 16, align_pages=8)  # as a bf16 forward plans it: no group
    out = torch_cascade.cascade_decode_attention(q, k, v, plan, 0.125)
    chunks = seen[0]
    if tiles_here():
        assert chunks is not None and chunks.offsets.tolist() == [0, 3, 6]
    else:
        assert chunks is None
    ref = torch_ref.decode_attention(q.float(), k.float(), v.float(), table, lens, 0.125)
    torch.testing.assert_close(out.float(), ref, **BF16_OUT)
