"""The fused element-wise Triton kernels against their torch twins (kernels/torch_fused), in triton's
interpreter at small shapes (on a machine with a GPU driver, compiled on CUDA tensors).

fp32 must agree to fp32 rounding; bf16 within one bf16 ulp of the twin, which rounds at the same points.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton

pytest.importorskip("triton")

from radixrt.kernels import torch_fused, triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # the same rounding points; an fp32 difference in a reduction may still move one ulp
        diff = (out.float() - ref.float()).abs()
        ulp = ref.float().abs().clamp_min(1e-3) * 2**-7
        assert bool((diff <= ulp).all()), f"max diff {diff.max().item()}"
        assert (out != ref).float().mean().item() < 0.02  # and that only rarely


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    close(triton_ops.rms_norm(x, w, 1e-5), torch_fused.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 80, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(6, 80, generator=gen).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(80, generator=gen)).to(dtype).to(DEVICE)
    ours_res, ref_res = res.clone(), res.clone()
    out = triton_ops.rms_norm(x, w, 1e-6, ours_res)
    ref = torch_fused.rms_norm(x, w, 1e-6, ref_res)
    assert torch.equal(ours_res, ref_res)  # one rounded add: bit-exact
    assert torch.equal(ref_res, (x + res))
    close(out, ref, dtype)


def test_rms_norm_strided_rows():
    x = torch.randn(4, 64, dtype=torch.float32, device=DEVICE)
    wide = torch.zeros(4, 100, device=DEVICE)
    wide[:, :64] = x
    w = torch.rand(64, device=DEVICE)
    close(triton_ops.rms_norm(wide[:, :64], w, 1e-5), torch_fused.rms_norm(x, w, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1500])
def test_silu_and_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (3 * torch.randn(3, 2 * inter, generator=gen)).to(dtype).to(DEVICE)
    close(triton_ops.silu_and_mul(gate_up), torch_fused.silu_and_mul(gate_up), dtype)


def _rope_case(dtype, heads, kv_heads, head_dim, tokens, page_size=4, pages=6, seed=0, rotary_dim=None):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(tokens, heads, head_dim)  # views into one projection output, as in the model
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    rot = rotary_dim or head_dim  # below head_dim: a partial rotary (the tables that wide)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.arange(64).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(DEVICE)
    cache = lambda: torch.zeros(pages, page_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)  # noqa: E731
    return qkv, q, k, v, cos, sin, positions, slots, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(4, 2, 16, 16), (3, 1, 24, 24), (6, 6, 8, 8),
                                                                 (4, 2, 16, 12), (3, 1, 24, 8)])
def test_rope_and_store(dtype, heads, kv_heads, head_dim, rotary_dim):
    qkv, q, k, v, cos, sin, positions, slots, cache = _rope_case(dtype, heads, kv_heads, head_dim, tokens=5,
                                                                 rotary_dim=rotary_dim)
    ref_qkv = qkv.clone()
    rq, rk, rv = ref_qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    rq, rk, rv = (t.view(5, -1, head_dim) for t in (rq, rk, rv))
    kc, vc, rkc, rvc = cache(), cache(), cache(), cache()
    out = triton_ops.rope_and_store(positions, q, k, v, cos, sin, slots, kc, vc)
    ref = torch_fused.rope_and_store(positions, rq, rk, rv, cos, sin, slots, rkc, rvc)
    assert out.data_ptr() == q.data_ptr()  # rotated in place
    close(q, rq, dtype)
    close(kc, rkc, dtype)
    assert torch.equal(vc, rvc)  # v is copied bit for bit



def test_rope_matches_transformers_formula():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    dtype = torch.bfloat16
    qkv, q, k, v, cos, sin, positions, slots, cache = _rope_case(dtype, 4, 2, 16, tokens=7, seed=3)
    q0, k0 = q.clone(), k.clone()
    kc, vc = cache(), cache()
    triton_ops.rope_and_store(positions, q, k, v, cos, sin, slots, kc, vc)
    c, s = cos[positions][None], sin[positions][None]  # [1, T, D]
    hq, hk = apply_rotary_pos_emb(q0.transpose(0, 1)[None], k0.transpose(0, 1)[None], c, s)
    close(q, hq[0].transpose(0, 1).contiguous(), dtype)
    flat = kc.view(-1, 2, 16)
    close(flat[slots], hk[0].transpose(0, 1).contiguous(), dtype)


def test_rope_and_store_skips_padding_slots():
    qkv, q, k, v, cos, sin, positions, slots, cache = _rope_case(torch.float32, 2, 1, 8, tokens=4)
    slots = slots.clone()
    slots[1] = -1
    slots[3] = -1
    kc, vc = cache(), cache()
    triton_ops.rope_and_store(positions, q, k, v, cos, sin, slots, kc, vc)
    written = (kc.view(-1, 8).abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert sorted(written) == sorted(slots[[0, 2]].tolist())
    assert int((vc != 0).any(-1).sum()) == 2
