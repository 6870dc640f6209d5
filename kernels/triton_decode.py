"""Paged decode attention (one query token per request), GQA-packed and split over the KV (flash-decoding).

Stage 1: one program per (request, kv head, KV split). It loads the ``group`` query heads that share the
kv head as one ``[BLOCK_H, D]`` tile, so each K/V page is read once for all of them, walks its share of
the request's keys through the page table ``BLOCK_N`` keys at a time with an fp32 online softmax, and
writes the normalised partial output and its log-sum-exp (base 2). With a single split it writes the
final output directly and stage 2 is skipped.

Stage 2: one program per (request, query head) merges the splits' partial (lse, output) pairs.

Split boundaries are a function of (seq_len, window, NUM_SPLITS, SPLIT_ALIGN) only, so both stages agree
on which splits hold keys without any extra metadata, whatever ``BLOCK_N`` the autotuner picks.
"""

from __future__ import annotations

import functools

import torch

from radixrt.kernels.triton_common import AUTOTUNE, autotune, dot_in_fp32, next_pow2, tl, triton

LOG2E = 1.4426950408889634
SPLIT_ALIGN = 64  # split lengths are multiples of this many keys
MIN_KEYS_PER_SPLIT = 128  # on an H200 at batch 1 x 4096 keys, 32 splits of 128 beat 16 of 256 (10.4 vs 11.6 us)
MAX_SPLITS = 32
# Stage-1 programs to aim for per multiprocessor. On an H200 at 4k contexts (8 K/V heads), grids of 512 programs
# (batch 32 with 2 splits, batch 64 with 1) read K/V at 62-66% of HBM bandwidth, and of 1,024 (batch 128) at 79.5%.
PROGRAMS_PER_SM = 8


@triton.jit
def _split_bounds(seq_len, window, split, NUM_SPLITS: tl.constexpr, SPLIT_ALIGN: tl.constexpr):
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    eff = seq_len - lo
    split_len = (eff + NUM_SPLITS - 1) // NUM_SPLITS
    split_len = (split_len + SPLIT_ALIGN - 1) // SPLIT_ALIGN * SPLIT_ALIGN
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    num_valid = (eff + split_len - 1) // split_len
    return start, end, num_valid


_DECODE_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
    # No register spills on sm_90 at head_dim 128 (python -m radixrt.kernels.triton_compile shows them).
    for bn, w, s in [(16, 4, 2), (32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 8, 2), (64, 8, 3), (64, 8, 4)]
]


# Integers that change with the batch (the page table's width, the split buffers' strides) are not specialized
# on: a new value divisible by 16, or equal to 1, would otherwise compile a new variant on a user's request.
_VARYING = ["stride_ptb", "stride_mob", "stride_moh", "stride_mos", "stride_mlb", "stride_mlh"]


@autotune(configs=_DECODE_CONFIGS, key=["GROUP", "HEAD_DIM", "PAGE_SIZE", "NUM_SPLITS", "DOT_F32"])
@triton.jit(do_not_specialize=_VARYING)
def _decode_stage1(
    Q, K_CACHE, V_CACHE, PAGE_TABLE, SEQ_LENS, OUT, MID_O, MID_LSE,
    sm_scale_log2, window,
    stride_qb, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_ptb,
    stride_ob, stride_oh,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLIT_ALIGN: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start, end, _ = _split_bounds(seq_len, window, split, NUM_SPLITS, SPLIT_ALIGN)
    if start >= end:
        return

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kh * GROUP + offs_h
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    page_row = PAGE_TABLE + b64 * stride_ptb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        page = tl.load(page_row + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = pos % PAGE_SIZE
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
        s = tl.where(n_mask[None, :], s * sm_scale_log2, float("-inf"))
        # Every block holds at least one valid key, so m_new is finite for every row.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / l_i[:, None]
    o_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(OUT + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=o_mask)
    else:
        tl.store(MID_O + b64 * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
                 out, mask=o_mask)
        tl.store(MID_LSE + b64 * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=h_mask)


@triton.jit(do_not_specialize=_VARYING[1:])
def _decode_stage2(
    MID_O, MID_LSE, SEQ_LENS, OUT, window,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_ALIGN: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SEQ_LENS + b)
    _, _, num_valid = _split_bounds(seq_len, window, 0, NUM_SPLITS, SPLIT_ALIGN)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_valid
    d_mask = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    lse = tl.load(MID_LSE + b64 * stride_mlb + h * stride_mlh + offs_s, mask=s_mask, other=float("-inf"))
    o = tl.load(MID_O + b64 * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # 0 for the splits that hold no keys
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + b64 * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors; in triton's interpreter a stand-in of 2, which still splits a tiny batch's KV
    (the split path runs) while keeping the grid, which the interpreter runs one program at a time, small."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def choose_num_splits(batch: int, kv_heads: int, max_len: int, multiprocessors: int) -> int:
    """Split the KV until the grid holds about ``PROGRAMS_PER_SM`` programs a multiprocessor (enough loads in flight
    to near the memory's bandwidth), keeping >= ``MIN_KEYS_PER_SPLIT`` keys a split.

    A power of two (at most 32) so that only a handful of kernel variants is ever compiled.
    """
    want = PROGRAMS_PER_SM * multiprocessors // max(1, batch * kv_heads)
    by_len = -(-max_len // MIN_KEYS_PER_SPLIT)
    n = max(1, min(want, by_len, MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
    num_splits: int | None = None,
    split_align: int = SPLIT_ALIGN,
) -> torch.Tensor:
    """See ``torch_ref.decode_attention``; ``num_splits``/``split_align`` override the split heuristic."""
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    device = q.device
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    page_table = page_table.to(device)
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        # The page table's width bounds the longest request without a device-to-host sync.
        num_splits = choose_num_splits(batch, kv_heads, page_table.shape[1] * page_size, multiprocessors(device))
    if num_splits > 1:
        mid_o = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=device)
        mid_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=device)
    else:
        mid_o = mid_lse = out  # unused
    f32 = dot_in_fp32(q.dtype)
    if AUTOTUNE:
        tuning = {}
    elif device.type == "cuda":  # one of the autotuned configs
        tuning = {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    else:  # the interpreter: tiny tiles, tiny tests
        tuning = {"BLOCK_N": 16, "num_warps": 4}
    _decode_stage1[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, out, mid_o, mid_lse,
        float(sm_scale) * LOG2E, int(sliding_window),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if num_splits > 1 else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, SPLIT_ALIGN=split_align, DOT_F32=f32,
        BLOCK_H=next_pow2(group, 16), BLOCK_D=next_pow2(head_dim, 16),
        **tuning,
    )
    if num_splits > 1:
        _decode_stage2[(batch, heads)](
            mid_o, mid_lse, seq_lens, out, int(sliding_window),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SPLIT_ALIGN=split_align,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(head_dim, 16),
            num_warps=4,
        )
    return out
