"""KV store: write a batch's new K and V into their (page, offset) slots in one launch."""

from __future__ import annotations

import torch

from radixrt.kernels.triton_common import next_pow2, tl, triton


@triton.jit
def _store_kv_kernel(
    K, V, K_CACHE, V_CACHE, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kco, stride_kch,
    stride_vcp, stride_vco, stride_vch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:  # padding (e.g. a padded batch): nothing to write
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(K_CACHE + page * stride_kcp + offset * stride_kco + offs_h[:, None] * stride_kch + offs_d[None, :],
             k, mask=mask)
    tl.store(V_CACHE + page * stride_vcp + offset * stride_vco + offs_h[:, None] * stride_vch + offs_d[None, :],
             v, mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    tokens = k.shape[0]
    if tokens == 0:
        return
    _, page_size, kv_heads, head_dim = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    # Cast on the host when dtypes differ (rare): the kernel then copies bits exactly.
    k = k.to(k_cache.dtype)
    v = v.to(v_cache.dtype)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slots = slots.to(k_cache.device)
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_H=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4,
    )
