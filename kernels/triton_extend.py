"""Paged extend attention: each request's new chunk attends to its cached prefix and causally to itself.

One program per (request, block of BLOCK_M new tokens, query head): a flash-attention loop over the
request's keys, read through the page table ``BLOCK_N`` positions at a time, from the first key the
block's queries can see (0, or the sliding window's start) up to the block's last query position. The
new tokens' K/V are already in the pages (``store_kv`` runs first), so prefix and chunk are one range;
the causal and window masks apply per (query, key) pair. Online softmax in fp32.
"""

from __future__ import annotations

import torch

from radixrt.kernels.triton_common import AUTOTUNE, autotune, dot_in_fp32, next_pow2, tl, triton

LOG2E = 1.4426950408889634

_EXTEND_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    # Gathered (paged) tiles cost pointer registers. At head_dim 128 on sm_90: 64x32 spills nothing, 64x64
    # 80 bytes, 128x64 about 450 (python -m radixrt.kernels.triton_compile prints registers and spills per config).
    for bm, bn, w, s in [(64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 1)]
]


@autotune(configs=_EXTEND_CONFIGS, key=["GROUP", "HEAD_DIM", "PAGE_SIZE", "DOT_F32"])
@triton.jit(do_not_specialize=["stride_ptb"])  # the page table's width changes with every batch
def _extend_kernel(
    Q, K_CACHE, V_CACHE, OUT, PAGE_TABLE, PREFIX_LENS, EXTEND_LENS, Q_STARTS,
    sm_scale_log2, window,
    stride_qt, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_ot, stride_oh,
    stride_ptb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    extend = tl.load(EXTEND_LENS + b)
    if mb * BLOCK_M >= extend:
        return
    prefix = tl.load(PREFIX_LENS + b)
    q_start = tl.load(Q_STARTS + b).to(tl.int64)
    kh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    rows = q_start + offs_m
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys this block can see: [lo, hi). hi is one past the block's last query position.
    hi = prefix + tl.minimum((mb + 1) * BLOCK_M, extend)
    lo = tl.where(window > 0, tl.maximum(prefix + mb * BLOCK_M - window + 1, 0), 0)
    lo = lo // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    page_row = PAGE_TABLE + b.to(tl.int64) * stride_ptb
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = k_pos < hi
        page = tl.load(page_row + k_pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = k_pos % PAGE_SIZE
        k_off = page * stride_kp + in_page * stride_ko + kh * stride_kh
        v_off = page * stride_vp + in_page * stride_vo + kh * stride_vh
        k = tl.load(K_CACHE + k_off[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(V_CACHE + v_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        allowed = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        allowed = allowed & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
        s = tl.where(allowed, s * sm_scale_log2, float("-inf"))
        # A row may see no key of this block (window, padding rows): keep its max finite for exp2.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """See ``torch_ref.extend_attention``; ``block_m``/``block_n`` pin the tiles where nothing autotunes;
    ``max_extend_len`` (the longest chunk, known on the host) spares reading it back from the device."""
    tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    device = q.device
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    out = torch.empty_like(q)
    batch = extend_lens.shape[0]
    if tokens == 0 or batch == 0:
        return out
    page_table = page_table.to(device)
    prefix_lens = prefix_lens.to(device=device, dtype=torch.int32)
    extend_lens = extend_lens.to(device=device, dtype=torch.int32)
    q_starts = (torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens).to(torch.int32)
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())  # a host sync: callers that know it pass it
    max_extend = max_extend_len
    if AUTOTUNE:
        tuning = {}
        grid = lambda meta: (batch, triton.cdiv(max_extend, meta["BLOCK_M"]), heads)  # noqa: E731
    else:
        if device.type == "cuda":  # one of the autotuned configs (no register spills at head_dim 128)
            bm, bn, tuning = block_m or 64, block_n or 32, {"num_warps": 8, "num_stages": 2}
        else:  # the interpreter: tiny tiles, tiny tests
            bm, bn, tuning = block_m or 16, block_n or 16, {"num_warps": 4}
        tuning.update(BLOCK_M=bm, BLOCK_N=bn)
        grid = (batch, triton.cdiv(max_extend, bm), heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, prefix_lens, extend_lens, q_starts,
        float(sm_scale) * LOG2E, int(sliding_window),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size, DOT_F32=dot_in_fp32(q.dtype),
        BLOCK_D=next_pow2(head_dim, 16),
        **tuning,
    )
    return out
