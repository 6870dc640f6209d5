"""Triton paged-attention kernels against the torch reference, in triton's interpreter at tiny shapes.

On a machine with a GPU driver the same tests run the compiled kernels on CUDA tensors.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton

pytest.importorskip("triton")

from paged_case import dense_reference, make_case  # noqa: E402
from radixrt.kernels import torch_ref, triton_ops  # noqa: E402
from radixrt.kernels.triton_decode import choose_num_splits, multiprocessors  # noqa: E402
from radixrt.kernels.triton_decode import decode_attention as triton_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def on_device(case):
    for name in ("q", "k_cache", "v_cache", "page_table", "prefix_lens", "extend_lens", "seq_lens"):
        setattr(case, name, getattr(case, name).to(DEVICE))
    return case


def assert_matches(out, ref, case, scale, window, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOL[dtype]
    assert (out.float() - ref.float()).abs().max().item() <= tol
    dense = dense_reference(case, scale, window).to(out.device)
    assert (out.double() - dense).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2 * tol)


def decode(case, scale, window, **kw):
    args = (case.q, case.k_cache, case.v_cache, case.page_table, case.seq_lens, scale, window)
    out = triton_decode(*args, **kw) if kw else triton_ops.decode_attention(*args)
    return out, torch_ref.decode_attention(*args)


def extend(case, scale, window):
    args = (case.q, case.k_cache, case.v_cache, case.page_table, case.prefix_lens, case.extend_lens, scale, window)
    return triton_ops.extend_attention(*args), torch_ref.extend_attention(*args)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(page_size, dtype):
    gen = torch.Generator().manual_seed(page_size)
    num_pages, kv_heads, head_dim, tokens = 5, 2, 64, 37
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(dtype)
    caches = [torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    ours = [c.clone().to(DEVICE) for c in caches]
    triton_ops.store_kv(ours[0], ours[1], slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    torch_ref.store_kv(caches[0], caches[1], slots, k, v)
    assert torch.equal(ours[0].cpu(), caches[0]) and torch.equal(ours[1].cpu(), caches[1])


def test_store_kv_casts_to_cache_dtype():
    k_cache, v_cache = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16), torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(3, 1, 16)
    slots = torch.tensor([7, 0, 2])
    torch_ref.store_kv(ref_k, ref_v, slots, k, -k)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    triton_ops.store_kv(k_cache, v_cache, slots.to(DEVICE), k.to(DEVICE), -k.to(DEVICE))
    assert torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v)


# ---------------------------------------------------------------- decode

DECODE_PREFIXES = [0, 6, 30, 15, 2, 70]  # seq_lens 1..71: ends mid-page for every page size


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_fp32(page_size, window):
    case = on_device(make_case(DECODE_PREFIXES, [1] * 6, page_size, heads=8, kv_heads=2, head_dim=64, seed=page_size))
    scale = 64**-0.5
    out, ref = decode(case, scale, window)
    assert_matches(out, ref, case, scale, window, torch.float32)


@pytest.mark.parametrize("page_size,window", [(1, 0), (16, 20), (64, 0)])
def test_decode_split_kv(page_size, window):
    """Flash-decoding: several KV splits per request, some of them empty for the short requests."""
    case = on_device(make_case(DECODE_PREFIXES, [1] * 6, page_size, heads=8, kv_heads=2, head_dim=64, seed=3))
    scale = 64**-0.5
    out, ref = decode(case, scale, window, num_splits=4, split_align=16)
    assert_matches(out, ref, case, scale, window, torch.float32)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 128), (8, 1, 64), (6, 2, 80)])
def test_decode_gqa_groups_and_head_dims(heads, kv_heads, head_dim):
    case = on_device(make_case([12, 40, 3], [1] * 3, 16, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=1))
    scale = head_dim**-0.5
    for kw in ({}, {"num_splits": 2, "split_align": 16}):
        out, ref = decode(case, scale, 0, **kw)
        assert_matches(out, ref, case, scale, 0, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_half_precision(dtype, head_dim):
    case = on_device(make_case([9, 33, 70], [1] * 3, 16, heads=8, kv_heads=2, head_dim=head_dim, dtype=dtype, seed=2))
    scale = head_dim**-0.5
    out, ref = decode(case, scale, 0, num_splits=2, split_align=16)
    assert_matches(out, ref, case, scale, 0, dtype)


def test_num_splits_heuristic():
    sms = 16  # 128 programs wanted
    assert choose_num_splits(1, 8, 32768, sms) == 16
    assert choose_num_splits(4, 8, 32768, sms) == 4
    assert choose_num_splits(8, 8, 32768, sms) == 2
    assert choose_num_splits(1, 1, 32768, sms) == 32
    assert choose_num_splits(1, 1, 300, sms) == 2  # at least 128 keys a split
    assert choose_num_splits(16, 8, 32768, sms) == 1  # a big batch fills the device alone
    assert choose_num_splits(256, 8, 32768, sms) == 1
    assert choose_num_splits(1, 1, 100, sms) == 1
    assert choose_num_splits(1, 8, 32768, 132) == 32  # an H100
    assert choose_num_splits(64, 8, 32768, 132) == 2
    # the interpreter's stand-in still splits a tiny batch (the split path runs in the tests)
    assert choose_num_splits(2, 3, 4096, multiprocessors(torch.device("cpu"))) == 2


# ---------------------------------------------------------------- extend

EXTEND_PREFIXES = [0, 5, 17, 70]  # 70: mid-page for pages of 16 and 64
EXTEND_LENS = [7, 1, 33, 9]  # 33: three query blocks of 16


@pytest.mark.parametrize("page_size,window", [(1, 0), (16, 6), (64, 0), (64, 6)])
def test_extend_fp32(page_size, window):
    case = on_device(make_case(EXTEND_PREFIXES, EXTEND_LENS, page_size, heads=4, kv_heads=1, head_dim=64, seed=page_size))
    scale = 64**-0.5
    out, ref = extend(case, scale, window)
    assert_matches(out, ref, case, scale, window, torch.float32)


def test_extend_zero_length_chunk_and_head_dim_128():
    case = on_device(make_case([4, 20, 0], [5, 0, 18], 16, heads=4, kv_heads=1, head_dim=128, seed=5))
    scale = 128**-0.5
    out, ref = extend(case, scale, 0)
    assert_matches(out, ref, case, scale, 0, torch.float32)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_extend_half_precision(dtype, head_dim):
    case = on_device(make_case([3, 40], [20, 6], 16, heads=4, kv_heads=2, head_dim=head_dim, dtype=dtype, seed=7))
    scale = head_dim**-0.5
    out, ref = extend(case, scale, 0)
    assert_matches(out, ref, case, scale, 0, dtype)


# ---------------------------------------------------------------- dispatch and the model


def test_backend_dispatch():
    from radixrt.memory.page_pool import KVLayout, PagePool
    from radixrt.model.attention import create_attention_backend
    from radixrt.model.torch_attention import TorchAttention
    from radixrt.model.triton_attention import TritonAttention

    pool = PagePool(KVLayout(num_layers=1, kv_heads=1, head_dim=16, page_size=4, dtype=torch.float32), 4, "cpu")
    assert type(create_attention_backend(pool, "auto")) is TorchAttention  # CPU tensors take the torch path
    assert type(create_attention_backend(pool, "triton")) is TritonAttention
    assert type(create_attention_backend(pool, "torch")) is TorchAttention
    assert create_attention_backend(pool, "torch").store_kv is torch_ref.store_kv
    assert create_attention_backend(pool, "triton").store_kv is triton_ops.store_kv
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend(pool, "flash")


def test_triton_ops_imports_without_triton(monkeypatch):
    """A CPU-only install has no triton: the module still imports, and the kernels say what to install."""
    import importlib.util

    monkeypatch.setitem(sys.modules, "triton", None)  # as if the optional extra were not installed
    spec = importlib.util.spec_from_file_location("triton_ops_without_triton", triton_ops.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert not fresh.AVAILABLE
    with pytest.raises(ImportError, match=r"radixrt\[triton\]"):
        fresh.decode_attention(None, None, None, None, None, 1.0)


@pytest.mark.parametrize("family,page_size", [("mistral", 4), ("qwen3", 16)])  # sliding window; GQA 4, head_dim 32
def test_model_logits_triton_equal_torch(tmp_path, family, page_size):
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.model.runner import ModelRunner
    from tiny_models import save_tiny_model

    save_tiny_model(family, tmp_path)
    prompts = [[5, 9, 3, 77, 12, 40, 8, 1, 99, 23, 64], [17, 2, 3], [100, 42, 42, 8, 9]]
    results = []
    for backend in ("torch", "triton"):
        runner = ModelRunner(tmp_path, dtype="float32", page_size=page_size, num_pages=32, attention_backend=backend)
        assert runner.attention.backend == backend
        pool = runner.pool
        pages = [pool.alloc(-(-(len(p) + 2) // page_size)) for p in prompts]
        # A prefill of the first part (ragged extend), the rest as an extend over the cached prefix,
        # then a decode step.
        half = [len(p) // 2 for p in prompts]
        logits = [runner.forward(ForwardBatch.build(
            [SeqChunk(p[:h], 0, pg, logits_from=0) for p, h, pg in zip(prompts, half, pages)], page_size))]
        logits.append(runner.forward(ForwardBatch.build(
            [SeqChunk(p[h:], h, pg, logits_from=0) for p, h, pg in zip(prompts, half, pages)], page_size)))
        for step in range(1):
            logits.append(runner.forward(ForwardBatch.build(
                [SeqChunk([11 + step], len(p) + step, pg) for p, pg in zip(prompts, pages)], page_size)))
        for pg in pages:
            pool.decref(pg)
        results.append(torch.cat(logits))
    assert (results[0] - results[1]).abs().max().item() <= 1e-5


# ---------------------------------------------------------------- the kernels compile for a real GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above run the compiled kernels")
def test_kernels_compile_for_sm90():
    """Lower every kernel (bf16 and fp32, Llama-8B-like shapes) to a Hopper cubin, no GPU needed: catches
    what the interpreter lets through (tile shape rules, types, early returns, resource limits)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists() and not shutil.which("ptxas"):
        pytest.skip("no ptxas to assemble a cubin")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "radixrt.kernels.triton_compile", "--quick"], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "spills" in out.stdout
