"""The C++ paged decode kernel must match the torch reference, and the runtime must work without it."""

import os

import pytest
import torch

from radixrt.kernels import cpu_kernels, torch_cascade, torch_ref

# Skipped only where the kernels are off by design; a failed build with a compiler present errors.
# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = [pytest.mark.usefixtures("cpu_kernel_module"), pytest.mark.serial]


def paged_case(batch, max_len, page_size, heads, kv_heads, dtype, seed=0, head_dim=16):
    gen = torch.Generator().manual_seed(seed)
    width = -(-max_len // page_size)
    num_pages = batch * width + 1
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = (torch.randperm(num_pages - 1, generator=gen)[: batch * width] + 1).view(batch, width).int()
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).int()
    lens[0] = max_len
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, lens


def reference_lse(q, k_cache, v_cache, table, lens, scale, window):
    """log-sum-exp of each query's scores, from the gathered keys."""
    page_size = k_cache.shape[1]
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        keys = torch_ref.gather_pages(k_cache, table[b].long()).view(-1, k_cache.shape[2], k_cache.shape[3])[:n]
        first = max(0, n - window) if window else 0
        keys = keys[first:].float().repeat_interleave(q.shape[1] // k_cache.shape[2], dim=1)  # [n, H, D]
        out.append(torch.logsumexp(torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale, dim=-1))
    assert page_size > 0
    return torch.stack(out)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("window", [0, 5])
def test_matches_torch_reference_fp32(page_size, heads, kv_heads, window):
    q, k, v, table, lens = paged_case(7, 45, page_size, heads, kv_heads, torch.float32, seed=page_size + heads)
    out, lse = cpu_kernels.paged_decode(q, k, v, table, lens, 0.25, window)
    ref = torch_ref.decode_attention(q, k, v, table, lens, 0.25, window)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, reference_lse(q, k, v, table, lens, 0.25, window), atol=1e-5, rtol=1e-5)


# 64 and 128 run with the rows in registers, 16 with a run-time width, 20 and 36 with a scalar tail
@pytest.mark.parametrize("head_dim", [20, 36, 64, 128])
@pytest.mark.parametrize("window", [0, 9])
def test_every_head_dim_matches_torch_reference_fp32(head_dim, window):
    q, k, v, table, lens = paged_case(5, 50, 16, 6, 2, torch.float32, seed=head_dim, head_dim=head_dim)
    out, lse = cpu_kernels.paged_decode(q, k, v, table, lens, head_dim**-0.5, window)
    ref = torch_ref.decode_attention(q, k, v, table, lens, head_dim**-0.5, window)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, reference_lse(q, k, v, table, lens, head_dim**-0.5, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_half_precision_caches(dtype, head_dim):
    q, k, v, table, lens = paged_case(5, 40, 16, 6, 2, dtype, seed=3, head_dim=head_dim)
    out, _ = cpu_kernels.paged_decode(q, k, v, table, lens, 0.25)
    ref = torch_ref.decode_attention(q.float(), k.float(), v.float(), table, lens, 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# bf16 outputs carry 2^-9 relative rounding, and the bf16 dot rounds each value's weight (<= 1) to bf16 as well
BF16_OUT = dict(atol=2e-2, rtol=2e-2)


# the bf16 dot's products on AMX tiles where usable, the bf16 dot where built, else the portable path; portable
BF16_PATHS = {"tiles": {}, "bf16 dot": {"tiles": False}, "portable": {"portable": True}}


@pytest.mark.parametrize("path", list(BF16_PATHS))
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])  # 48: never the bf16 dot (not a multiple of 32)
@pytest.mark.parametrize("page_size,window", [(16, 0), (4, 9), (1, 0)])
def test_bf16_paths_match_the_fp32_reference(path, head_dim, page_size, window):
    """bf16 pages read by the kernel's paths, against fp32 attention over the same bf16 values; lengths
    cover whole and partial blocks of keys (a block is a vector's width of them)."""
    q, k, v, table, lens = paged_case(6, 70, page_size, 6, 2, torch.bfloat16, seed=head_dim + page_size,
                                      head_dim=head_dim)
    lens[1:4] = torch.tensor([1, 16, 17], dtype=torch.int32)
    scale = head_dim**-0.5
    out, lse = cpu_kernels.paged_decode(q, k, v, table, lens, scale, window, **BF16_PATHS[path])
    ref = torch_ref.decode_attention(q.float(), k.float(), v.float(), table, lens, scale, window)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, **BF16_OUT)
    torch.testing.assert_close(lse, reference_lse(q, k, v, table, lens, scale, window), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(3, 1), (5, 1), (7, 1), (8, 2)])  # GQA groups in whole and split tiles
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_long_contexts_in_every_group_size(tiles, heads, kv_heads, head_dim):
    """Contexts of several spans of keys (the bf16 dot's softmax rescales once a span), ending on and off a span's
    edge, for query groups that fill the kernel's row tiles and groups that leave a smaller tile."""
    q, k, v, table, lens = paged_case(6, 520, 16, heads, kv_heads, torch.bfloat16, seed=heads + head_dim,
                                      head_dim=head_dim)
    lens[:] = torch.tensor([1, 127, 128, 129, 300, 520], dtype=torch.int32)
    scale = head_dim**-0.5
    out, lse = cpu_kernels.paged_decode(q, k, v, table, lens, scale, tiles=tiles)
    ref = torch_ref.decode_attention(q.float(), k.float(), v.float(), table, lens, scale)
    torch.testing.assert_close(out.float(), ref, **BF16_OUT)
    torch.testing.assert_close(lse, reference_lse(q, k, v, table, lens, scale, 0), atol=1e-4, rtol=1e-4)


def test_bf16_dot_is_built_where_the_cpu_has_it(monkeypatch):
    """AVX512-BF16 CPUs get the vdpbf16ps path, unless the build was narrowed (RADIXRT_CPU_VECTORS)."""
    widest = cpu_kernels.vector_levels(" ".join(cpu_kernels.cpu_flags()))[0] == "avx512bf16"
    narrowed = os.environ.get(cpu_kernels.VECTORS_ENV, "") not in ("", "avx512bf16")
    assert cpu_kernels.bf16_dot_built() == (widest and not narrowed)


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    q, k, v, table, lens = paged_case(3, 20, 4, 6, 2, torch.float32)
    with pytest.raises(RuntimeError, match="seq_lens"):
        cpu_kernels.paged_decode(q, k, v, table, lens + 100, 0.25)
    bad = table.clone()
    bad[1, 0] = k.shape[0]
    with pytest.raises(RuntimeError, match="page ids"):
        cpu_kernels.paged_decode(q, k, v, bad, lens, 0.25)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernels.paged_decode(q.double(), k, v, table, lens, 0.25)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_kernels.paged_decode(q, k, v, table.long(), lens, 0.25)


def test_cascade_same_with_and_without_the_kernel(monkeypatch):
    """The cascade merges the kernel's log-sum-exp with the shared part's; the torch path must agree."""
    page_size, heads, kv_heads = 4, 6, 2
    gen = torch.Generator().manual_seed(5)
    shared = list(range(1, 6))
    rows = [shared + [10 + 3 * r, 11 + 3 * r, 12 + 3 * r] for r in range(4)]
    table = torch.tensor(rows, dtype=torch.int32)
    lens = torch.tensor([5 * page_size + n for n in (1, 4, 9, 12)], dtype=torch.int32)
    k = torch.randn(30, page_size, kv_heads, 16, generator=gen)
    v = torch.randn(30, page_size, kv_heads, 16, generator=gen)
    q = torch.randn(4, heads, 16, generator=gen)
    plan = torch_cascade.plan_decode(table, lens, page_size)
    assert plan.groups
    with_kernel = torch_cascade.cascade_decode_attention(q, k, v, plan, 0.25)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    without = torch_cascade.cascade_decode_attention(q, k, v, plan, 0.25)
    torch.testing.assert_close(with_kernel, without, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(with_kernel, torch_ref.decode_attention(q, k, v, table, lens, 0.25), atol=2e-6, rtol=1e-5)


def group_case(members: int, shared_pages: int, page_size: int = 4, heads: int = 6, kv_heads: int = 2,
               dtype=torch.float32, head_dim: int = 16):
    """``members`` requests that begin with the same ``shared_pages`` pages, plus one loner (the last row)."""
    gen = torch.Generator().manual_seed(members + shared_pages)
    own_pages = 3
    num_pages = shared_pages + (members + 1) * (own_pages + shared_pages) + 1
    ids = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    shared = ids[:shared_pages]
    rest = iter(ids[shared_pages:])
    rows = [shared + [next(rest) for _ in range(own_pages)] for _ in range(members)]
    rows.append([next(rest) for _ in range(shared_pages + own_pages)])
    table = torch.tensor(rows, dtype=torch.int32)
    lens = torch.randint(shared_pages * page_size + 1, (shared_pages + own_pages) * page_size + 1,
                         (members + 1,), generator=gen).int()
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(members + 1, heads, head_dim, generator=gen).to(dtype)
    return q, k, v, table, lens, shared


def chunked(members: int, size: int, shared: list[int]) -> cpu_kernels.CascadeChunks:
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)
    order = list(range(members))[::-1] + [members]  # any order of rows: here reversed, the loner last
    offsets = list(range(0, members, size)) + [members, members + 1]
    return cpu_kernels.CascadeChunks(rows=as_int(order), offsets=as_int(offsets),
                                     groups=as_int([0] * (len(offsets) - 2) + [-1]),
                                     shared_table=as_int([shared]), shared_pages=as_int([len(shared)]))


@pytest.mark.parametrize("size", [1, 3, 10])  # a chunk per request, uneven chunks, the whole group at once
@pytest.mark.parametrize("page_size", [1, 4])
def test_cascade_in_the_kernel_matches_plain_decode_for_any_chunking(size, page_size):
    members, shared_pages = 10, 5
    q, k, v, table, lens, shared = group_case(members, shared_pages, page_size)
    shift = torch.tensor([shared_pages] * members + [0])
    own_table = torch.stack([torch.roll(row, -int(s)) for row, s in zip(table, shift)]).int()
    own_lens = (lens - shift * page_size).int()
    out, lse = cpu_kernels.paged_decode(q, k, v, own_table, own_lens, 0.25, 0, chunked(members, size, shared))
    torch.testing.assert_close(out, torch_ref.decode_attention(q, k, v, table, lens, 0.25), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, reference_lse(q, k, v, table, lens, 0.25, 0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: bf16 takes the bf16 dot where it is built
def test_cascade_in_the_kernel_half_precision(dtype, head_dim):
    q, k, v, table, lens, shared = group_case(6, 3, dtype=dtype, head_dim=head_dim)
    plan = torch_cascade.plan_decode(table, lens, 4)
    assert plan.groups
    out = torch_cascade.cascade_decode_attention(q, k, v, plan, 0.25)
    ref = torch_ref.decode_attention(q.float(), k.float(), v.float(), table, lens, 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_plan_chunks_keep_every_thread_busy(monkeypatch):
    q, k, v, table, lens, shared = group_case(12, 2)
    plan = torch_cascade.plan_decode(table, lens, 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    chunks = plan.kernel_chunks(kv_heads=2)
    sizes = (chunks.offsets[1:] - chunks.offsets[:-1]).tolist()
    assert sorted(chunks.rows.tolist()) == list(range(13))
    assert sizes == [1] * 13 and chunks.groups.tolist() == [0] * 12 + [-1]  # 26 items for 24 wanted: 1 a chunk
    plan = torch_cascade.plan_decode(table, lens, 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert (plan.kernel_chunks(kv_heads=2).offsets.diff()).tolist() == [12, 1]  # 4 items for 3 wanted: whole
    plan = torch_cascade.plan_decode(table, lens, 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert (plan.kernel_chunks(kv_heads=2).offsets.diff()).tolist() == [4, 4, 4, 1]  # 12 * 2 / 6 items wanted


def test_many_small_groups_stay_whole_chunks(monkeypatch):
    """A verify step's rows: 8 requests of 3 rows, each request's rows sharing its pages. 8 chunks already keep
    2 threads busy, so no group is cut (cut into single rows, each row would read its request's pages again)."""
    page_size, pages_each = 4, 5
    table = torch.arange(8 * pages_each, dtype=torch.int32).view(8, pages_each).repeat_interleave(3, dim=0)
    lens = torch.tensor([17, 18, 19] * 8, dtype=torch.int32)
    plan = torch_cascade.plan_decode(table, lens, page_size)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    chunks = plan.kernel_chunks(kv_heads=3)
    assert (chunks.offsets[1:] - chunks.offsets[:-1]).tolist() == [3] * 8
    assert sorted(chunks.groups.tolist()) == list(range(8))


def test_bad_cascade_tables_raise():
    members = 4
    q, k, v, table, lens, shared = group_case(members, 2)
    own_lens = (lens - torch.tensor([8] * members + [0])).int()
    good = chunked(members, 2, shared)

    def call(chunks, window=0, **change):
        fields = {name: getattr(chunks, name) for name in ("rows", "offsets", "groups", "shared_table", "shared_pages")}
        fields.update(change)
        return cpu_kernels.paged_decode(q, k, v, table, own_lens, 0.25, window, cpu_kernels.CascadeChunks(**fields))

    call(good)
    with pytest.raises(RuntimeError, match="every request once"):
        call(good, rows=torch.tensor([0, 0, 1, 2, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="chunk_group"):
        call(good, groups=torch.tensor([0, 1, -1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="page ids"):
        call(good, shared_table=torch.tensor([[shared[0], k.shape[0]]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="chunk_offsets"):
        call(good, offsets=torch.tensor([0, 3, 2, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="width"):
        call(good, shared_pages=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sliding window"):
        call(good, window=4)
    with pytest.raises(RuntimeError, match="int32"):
        call(good, rows=good.rows.long())
    with pytest.raises(RuntimeError, match="needs all"):
        cpu_kernels._module().paged_decode(q, k, v, table, own_lens, 0.25, 0, good.rows, None, None, None, None,
                                          False, True)


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: sliding window 5
def test_model_decode_same_with_and_without_the_kernel(tmp_path, monkeypatch, family):
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.model.runner import ModelRunner
    from tiny_models import save_tiny_model

    save_tiny_model(family, tmp_path)
    prompts = [[3, 8, 1, 9, 4, 4, 7, 2, 11], [5, 6], [1, 2, 3, 4, 5, 6, 7]]
    pages = [[1, 2, 3], [4], [5, 6]]

    def prefill_then_decode() -> torch.Tensor:
        # a runner of its own: its linear layers are packed for the kernels present when it loads
        runner = ModelRunner(tmp_path, dtype="float32", num_pages=32, page_size=4)
        runner.forward(ForwardBatch.build([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], 4))
        return runner.forward(ForwardBatch.build([SeqChunk([9], len(p), pg) for p, pg in zip(prompts, pages)], 4))

    with_kernel = prefill_then_decode()
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    torch.testing.assert_close(with_kernel, prefill_then_decode(), atol=1e-5, rtol=1e-5)
