"""Fused element-wise kernels of a decoder layer: (residual add +) RMSNorm, SiLU-and-mul, rotary + K/V store.

Each replaces several torch ops (and their launches) with one kernel, and rounds to the activations' dtype
exactly where transformers' eager modules round (their torch twins are in :mod:`radixrt.kernels.torch_fused`):

- ``rms_norm``: ``r = x + residual`` (rounded; written back into ``residual``), ``n = r * rsqrt(mean(r^2) + eps)``
  in fp32, rounded, then ``weight * n`` rounded. One program per row.
- ``silu_and_mul``: ``silu(gate)`` rounded, times ``up``, rounded. One program per (row, column block).
- ``rope_and_store``: ``q * cos + rotate_half(q) * sin`` with each product and the sum rounded (cos/sin in the
  activations' dtype, as transformers casts them), ``q`` rotated in place; ``k`` rotated the same way and
  written with ``v`` into the token's cache slot (a slot < 0, a padding row, writes nothing). A partial rotary
  (tables narrower than the heads) rotates each head's first elements and passes the rest. One program per
  token, every head.

Loads are upcast to fp32 at once (triton's interpreter computes bf16 wrongly); all arithmetic is fp32, and each
rounding point is ``round_to`` (to nearest even, also in the interpreter), so a store only converts exact values.
"""

from __future__ import annotations

import torch

from radixrt.kernels.triton_common import next_pow2, round_to, tl, triton


@triton.jit
def _rms_norm_kernel(
    X, RES, W, OUT,
    stride_x, stride_r, stride_o,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(RES + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, RES.dtype.element_ty)  # the residual stream is kept in the activations' dtype
        tl.store(RES + row * stride_r + offs, x.to(RES.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = round_to(x * tl.rsqrt(var + eps), OUT.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, round_to(w * normed, OUT.dtype.element_ty).to(OUT.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[T, N]``; with ``residual``, of ``x + residual``, which is written into
    ``residual`` (in place, as the fused CPU op does)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out
    assert x.stride(1) == 1 and weight.is_contiguous(), "rows must be contiguous"
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
    block = next_pow2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        n, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out


@triton.jit
def _silu_and_mul_kernel(
    GATE_UP, OUT, stride_g, stride_o, n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(GATE_UP + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * stride_g + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + offs, round_to(act * up, OUT.dtype.element_ty).to(OUT.dtype.element_ty),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[T, 2I]`` gate/up projection."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    assert gate_up.stride(1) == 1, "rows must be contiguous"
    block = min(1024, next_pow2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4,
    )
    return out


@triton.jit
def _rotate(X, x_row, stride_h, offs_h, offs_d, h_mask, d_mask, cos, sin, HALF: tl.constexpr,
            OUT_DTYPE: tl.constexpr):
    """Both halves of the heads at ``x_row``, rotated; each product and sum rounded to OUT_DTYPE."""
    base = X + x_row + offs_h[:, None] * stride_h + offs_d[None, :]
    mask = h_mask[:, None] & d_mask[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    x1c = round_to(x1 * cos[None, :], OUT_DTYPE)
    x2s = round_to(x2 * sin[None, :], OUT_DTYPE)
    x2c = round_to(x2 * cos[None, :], OUT_DTYPE)
    x1s = round_to(x1 * sin[None, :], OUT_DTYPE)
    return round_to(x1c - x2s, OUT_DTYPE).to(OUT_DTYPE), round_to(x2c + x1s, OUT_DTYPE).to(OUT_DTYPE)


@triton.jit
def _rope_store_kernel(
    Q, K, V, POSITIONS, COS, SIN, SLOTS, K_CACHE, V_CACHE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_FULL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POSITIONS + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    # cos/sin repeat over the two halves (transformers' cat((freqs, freqs))): the first half serves both
    cos = tl.load(COS + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    dtype = Q.dtype.element_ty

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < HEADS
    q1, q2 = _rotate(Q, t * stride_qt, stride_qh, offs_h, offs_d, h_mask, d_mask, cos, sin, HALF, dtype)
    q_base = Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q_mask = h_mask[:, None] & d_mask[None, :]
    tl.store(q_base, q1, mask=q_mask)
    tl.store(q_base + HALF, q2, mask=q_mask)

    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        offs_kh = tl.arange(0, BLOCK_KH)
        kh_mask = offs_kh < KV_HEADS
        kv_mask = kh_mask[:, None] & d_mask[None, :]
        k1, k2 = _rotate(K, t * stride_kt, stride_kh, offs_kh, offs_d, kh_mask, d_mask, cos, sin, HALF, dtype)
        kc = K_CACHE + page * stride_kcp + offset * stride_kco + offs_kh[:, None] * stride_kch + offs_d[None, :]
        tl.store(kc, k1.to(K_CACHE.dtype.element_ty), mask=kv_mask)
        tl.store(kc + HALF, k2.to(K_CACHE.dtype.element_ty), mask=kv_mask)
        offs_f = tl.arange(0, BLOCK_FULL)
        full_mask = kh_mask[:, None] & (offs_f < HEAD_DIM)[None, :]
        if 2 * HALF < HEAD_DIM:  # a partial rotary: the rest of each k head passes unrotated
            pass_mask = full_mask & (offs_f >= 2 * HALF)[None, :]
            k_src = K + t * stride_kt + offs_kh[:, None] * stride_kh + offs_f[None, :]
            kp = K_CACHE + page * stride_kcp + offset * stride_kco + offs_kh[:, None] * stride_kch + offs_f[None, :]
            tl.store(kp, tl.load(k_src, mask=pass_mask, other=0.0).to(K_CACHE.dtype.element_ty), mask=pass_mask)
        v_src = V + t * stride_vt + offs_kh[:, None] * stride_vh + offs_f[None, :]
        vc = V_CACHE + page * stride_vcp + offset * stride_vco + offs_kh[:, None] * stride_vch + offs_f[None, :]
        tl.store(vc, tl.load(v_src, mask=full_mask, other=0.0).to(V_CACHE.dtype.element_ty), mask=full_mask)


def rope_and_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``q`` ``[T, heads, D]`` in place and return it; rotate ``k`` and store it with ``v``
    (``[T, kv_heads, D]``) into ``slots`` of the caches ``[pages, page_size, kv_heads, D]``.

    ``cos``/``sin`` ``[rows, R]`` are in the activations' dtype (rounded as transformers rounds them); ``positions``
    are their rows. ``R < D`` (a partial rotary): each head's first ``R`` elements rotate, the rest pass unchanged.
    """
    tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, cache_dim = k_cache.shape
    rot = cos.shape[1]
    if tokens == 0:
        return q
    assert rot % 2 == 0 and rot <= head_dim and cache_dim == head_dim and k.shape[1] == kv_heads
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.stride(1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    assert cos.dtype == q.dtype == k.dtype, "cos/sin must be in the activations' dtype"
    _rope_store_kernel[(tokens,)](
        q, k, v, positions, cos, sin, slots, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, HALF=rot // 2, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_H=next_pow2(heads), BLOCK_KH=next_pow2(kv_heads), BLOCK_D=next_pow2(rot // 2),
        BLOCK_FULL=next_pow2(head_dim),
        num_warps=4,
    )
    return q
