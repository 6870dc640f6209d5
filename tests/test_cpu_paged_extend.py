"""The C++ paged extend (prefill attention over bf16 pages read in place) against fp32 attention over the same
bf16 values, on every CPU: AVX-512 builds run it vectorized (and the runtime takes it), others its scalar twin."""

import pytest
import torch

from radixrt.kernels import cpu_kernels, torch_ref

# Skipped only where the kernels are off by design; a failed build with a compiler present errors.
# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = [pytest.mark.usefixtures("cpu_kernel_module"), pytest.mark.serial]

# bf16 outputs carry 2^-9 relative rounding, and each value's weight (<= 1) is rounded to bf16 as well
BF16_OUT = dict(atol=2e-2, rtol=2e-2)


def extend_case(prefixes, extends, page_size=16, heads=9, kv_heads=3, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-(p + e) // page_size) for p, e in zip(prefixes, extends))
    num_pages = len(prefixes) * width + 1
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).bfloat16()
    table = (torch.randperm(num_pages - 1, generator=gen)[: len(prefixes) * width] + 1).view(-1, width).int()
    q = torch.randn(sum(extends), heads, head_dim, generator=gen).bfloat16()
    return q, k, v, table, torch.tensor(prefixes, dtype=torch.int32), torch.tensor(extends, dtype=torch.int32)


def check(q, k, v, table, prefixes, extends, window=0):
    scale = q.shape[-1] ** -0.5
    out = cpu_kernels.paged_extend(q, k, v, table, prefixes, extends, scale, window)
    ref = torch_ref.extend_attention(q.float(), k.float(), v.float(), table, prefixes, extends, scale, window)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, **BF16_OUT)


# prompts from scratch, after a cached prefix, one token, several requests back to back (one with no new token),
# keys over several softmax spans of 64 with a partial last one
@pytest.mark.parametrize("prefixes,extends", [([0], [37]), ([100], [50]), ([5, 0, 40, 9], [20, 1, 17, 0]), ([16], [16]),
                                              ([301], [70]), ([0, 64], [200, 64])])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_matches_the_fp32_reference(prefixes, extends, page_size):
    check(*extend_case(prefixes, extends, page_size, seed=page_size + sum(extends)))


# query heads per kv head: 1 (48 tokens an item), 3 (16), 8 (6, padding rows), 16 (3)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1), (32, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_every_group_and_head_dim(heads, kv_heads, head_dim):
    check(*extend_case([7, 30], [61, 33], 16, heads, kv_heads, head_dim, seed=heads + head_dim))


@pytest.mark.parametrize("window", [1, 7, 40, 100])
def test_sliding_window(window):
    check(*extend_case([90, 0], [45, 30], 4, seed=window), window=window)
    check(*extend_case([250], [90], 16, seed=window), window=window)  # spans wholly outside the window


def test_the_runtime_takes_it_on_avx512_builds_in_bf16_without_amx(monkeypatch):
    q, k, *_ = extend_case([0], [4])
    vectorized = cpu_kernels._module().paged_extend_vectorized()
    assert vectorized == cpu_kernels.compile_flags()[3].endswith("AVX512")
    assert cpu_kernels.paged_extend_usable(q, k) == (vectorized and "amx_bf16" not in cpu_kernels.cpu_flags())
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert not cpu_kernels.paged_extend_usable(q, k)  # torch's flash attention runs on the AMX tiles there
    assert not cpu_kernels.paged_extend_usable(q.float(), k.float())
    assert not cpu_kernels.paged_extend_usable(q[..., :48], k[..., :48])


def test_bad_inputs_raise():
    q, k, v, table, prefixes, extends = extend_case([0, 3], [5, 6], page_size=4)
    scale = 0.125
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.paged_extend(q.float(), k.float(), v.float(), table, prefixes, extends, scale)
    narrow = [t[..., :48].contiguous() for t in (q, k, v)]
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_kernels.paged_extend(*narrow, table, prefixes, extends, scale)
    with pytest.raises(RuntimeError, match="fit the page table"):
        cpu_kernels.paged_extend(q, k, v, table, prefixes + 100, extends, scale)
    bad = table.clone()
    bad[1, 0] = k.shape[0]
    with pytest.raises(RuntimeError, match="page ids"):
        cpu_kernels.paged_extend(q, k, v, bad, prefixes, extends, scale)
    with pytest.raises(RuntimeError, match="every request's new tokens"):
        cpu_kernels.paged_extend(q[:-1], k, v, table, prefixes, extends, scale)


def test_backend_extend_same_with_and_without_the_kernel(monkeypatch):
    """The torch backend's extend (a mixed batch: decode rows split off) in bf16, the kernel against torch's."""
    from radixrt.memory.page_pool import KVLayout, PagePool
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.model.torch_attention import TorchAttention

    from radixrt.model import torch_attention

    monkeypatch.setattr(torch_attention, "SHORT_EXTEND", 0)  # the extend path, not decode rows
    monkeypatch.setattr(torch_attention, "TILED_ROWS_NEW", 0)
    page_size, d = 4, 64
    backend = TorchAttention(PagePool(KVLayout(1, 3, d, page_size, torch.bfloat16), num_pages=16))
    gen = torch.Generator().manual_seed(2)
    for cache in (backend.pool.k_caches[0], backend.pool.v_caches[0]):
        cache.copy_(torch.randn(cache.shape, generator=gen).bfloat16())
    chunks = [SeqChunk(list(range(9)), 3, [1, 2, 3]), SeqChunk([5], 6, [4, 5]), SeqChunk([1], 2, [6]),
              SeqChunk(list(range(5)), 0, [7, 8])]
    batch = ForwardBatch.build(chunks, page_size)
    q = torch.randn(batch.positions.numel(), 9, d, generator=gen).bfloat16()
    fused = backend.attend(q, backend.pool.k_caches[0], backend.pool.v_caches[0], batch, 0.125, 0)
    monkeypatch.setattr(cpu_kernels, "paged_extend_usable", lambda *args: False)
    batch = ForwardBatch.build(chunks, page_size)  # a fresh plan cache
    plain = backend.attend(q, backend.pool.k_caches[0], backend.pool.v_caches[0], batch, 0.125, 0)
    torch.testing.assert_close(fused.float(), plain.float(), **BF16_OUT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_extends_run_as_decode_rows_with_extend_attention_s_result(dtype):
    """A verify step's rows (a few new tokens a request, some requests with one) go through the decode kernel, a
    row per token over its request's keys up to itself; the result is causal extend attention's. A longer
    extend keeps the extend path."""
    from radixrt.memory.page_pool import KVLayout, PagePool
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.model.torch_attention import SHORT_EXTEND, TorchAttention

    page_size, d = 4, 64
    backend = TorchAttention(PagePool(KVLayout(1, 3, d, page_size, dtype), num_pages=40))
    gen = torch.Generator().manual_seed(5)
    for cache in (backend.pool.k_caches[0], backend.pool.v_caches[0]):
        cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    # prefixes ending inside a page and on its edge; 1 to 9 new tokens
    chunks = [SeqChunk(list(range(5)), 7, [1, 2, 3]), SeqChunk([5], 6, [4, 5]),
              SeqChunk(list(range(9)), 8, [6, 7, 8, 9, 10]), SeqChunk(list(range(3)), 0, [11]),
              SeqChunk(list(range(2)), 11, [12, 13, 14, 15])]
    batch = ForwardBatch.build(chunks, page_size)
    q = torch.randn(batch.positions.numel(), 9, d, generator=gen).to(dtype)
    out = backend.attend(q, backend.pool.k_caches[0], backend.pool.v_caches[0], batch, 0.125, 0)
    assert batch.attn_cache["as_rows"].all()
    ref = torch_ref.extend_attention(q.float(), backend.pool.k_caches[0].float(), backend.pool.v_caches[0].float(),
                                     batch.page_table, batch.prefix_lens, batch.extend_lens, 0.125, 0, {})
    tolerance = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else BF16_OUT
    torch.testing.assert_close(out.float(), ref, **tolerance)
    long = ForwardBatch.build([SeqChunk(list(range(SHORT_EXTEND + 1)), 2, list(range(16, 22)))], page_size)
    q = torch.randn(SHORT_EXTEND + 1, 9, d, generator=gen).to(dtype)
    backend.attend(q, backend.pool.k_caches[0], backend.pool.v_caches[0], long, 0.125, 0)
    tiled = dtype == torch.bfloat16 and cpu_kernels.decode_tiles_usable()  # longer rows pay on AMX tiles
    assert bool(long.attn_cache["as_rows"].all()) is tiled


def test_which_requests_attend_as_decode_rows():
    """Up to SHORT_EXTEND new tokens everywhere; on AMX tiles chunks of up to TILED_ROWS_NEW new tokens over up to
    TILED_ROWS_KEYS keys too; under deterministic inference every request."""
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.model.torch_attention import SHORT_EXTEND, TILED_ROWS_KEYS, TILED_ROWS_NEW, row_requests

    def chunk(new: int, prefix: int) -> SeqChunk:
        return SeqChunk([1] * new, prefix, list(range(-(-(prefix + new) // 16))))

    batch = ForwardBatch.build([
        chunk(SHORT_EXTEND, 5000), chunk(SHORT_EXTEND + 1, 0), chunk(TILED_ROWS_NEW, TILED_ROWS_KEYS - TILED_ROWS_NEW),
        chunk(TILED_ROWS_NEW + 1, 0), chunk(100, TILED_ROWS_KEYS - 99), chunk(1, 9000),
    ], 16)
    assert row_requests(batch, tiled=False).tolist() == [True, False, False, False, False, True]
    assert row_requests(batch, tiled=True).tolist() == [True, True, True, False, False, True]
    assert row_requests(batch, tiled=False, always=True).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_batch_s_short_extends_get_the_bits_they_get_without_the_prefill(dtype, monkeypatch):
    """A prefill chunk beside a verify step and a decode: the verify and decode rows go through the decode kernel
    as they do in a batch of their own, so they get the same bits (a verify step's tokens do not depend on
    whether a prompt was being prefilled at the time); the prefill gets extend attention's result."""
    from radixrt.memory.page_pool import KVLayout, PagePool
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.model.torch_attention import SHORT_EXTEND, TorchAttention

    page_size, d = 16, 64
    backend = TorchAttention(PagePool(KVLayout(1, 3, d, page_size, dtype), num_pages=40))
    from radixrt.model import torch_attention

    monkeypatch.setattr(torch_attention, "TILED_ROWS_NEW", 0)  # the prefill's chunk attends as an extend on AMX too
    gen = torch.Generator().manual_seed(9)
    for cache in (backend.pool.k_caches[0], backend.pool.v_caches[0]):
        cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    shared = list(range(1, 12))  # the verify step and the decode share 11 pages (not whole spans of the bf16 walk)
    short = [SeqChunk(list(range(4)), 11 * page_size + 5, shared + [12]), SeqChunk([7], 12 * page_size + 3,
                                                                                 shared + [13, 14])]
    prefill = SeqChunk(list(range(SHORT_EXTEND + 20)), 10, [20, 21, 22])
    alone = ForwardBatch.build(short, page_size)
    mixed = ForwardBatch.build([short[0], prefill, short[1]], page_size)
    q_short = torch.randn(5, 9, d, generator=gen).to(dtype)
    q_prefill = torch.randn(SHORT_EXTEND + 20, 9, d, generator=gen).to(dtype)
    caches = backend.pool.k_caches[0], backend.pool.v_caches[0]
    out_alone = backend.attend(q_short, *caches, alone, 0.125, 0)
    out_mixed = backend.attend(torch.cat([q_short[:4], q_prefill, q_short[4:]]), *caches, mixed, 0.125, 0)
    assert alone.attn_cache["as_rows"].all() and mixed.attn_cache["as_rows"].tolist() == [True, False, True]
    assert torch.equal(out_mixed[:4], out_alone[:4]) and torch.equal(out_mixed[-1:], out_alone[4:])
    ref = torch_ref.extend_attention(torch.cat([q_short[:4], q_prefill, q_short[4:]]).float(), caches[0].float(),
                                     caches[1].float(), mixed.page_table, mixed.prefix_lens, mixed.extend_lens,
                                     0.125, 0, {})
    tolerance = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else BF16_OUT
    torch.testing.assert_close(out_mixed.float(), ref, **tolerance)


def test_the_tiled_rows_limit_is_read_from_the_environment():
    import os
    import subprocess
    import sys

    code = "from radixrt.model import torch_attention as t; print(t.TILED_ROWS_NEW)"
    for value, want in (("0", "0"), (None, "512")):
        env = {k: v for k, v in os.environ.items() if k != "RADIXRT_TILED_ROWS_NEW"}
        if value is not None:
            env["RADIXRT_TILED_ROWS_NEW"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want
