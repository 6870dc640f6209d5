"""Paged attention in plain torch: the CPU path of the runtime and the oracle for the Triton kernels.

KV layout, per layer: ``k_cache`` and ``v_cache`` are ``[num_pages, page_size, kv_heads, head_dim]``.
A request's token at position ``p`` lives in page ``page_table[r, p // page_size]`` at offset
``p % page_size`` (its *slot* is ``page * page_size + offset``).

The new tokens' K/V are written with :func:`store_kv` before attention runs, so both entry points
read every key (cached prefix and new tokens alike) from the pages.

GQA is folded into the query: the ``group = heads // kv_heads`` query heads that share one KV head
attend as one ``[group * tokens]`` block against that head's keys, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write ``k``/``v`` (``[tokens, kv_heads, head_dim]``) into the given flat cache slots."""
    num_pages, page_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(num_pages * page_size, kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(num_pages * page_size, kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_slots(page_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat cache slots of ``positions`` (``[B, L]``) for each request's page table (``[B, pages]``)."""
    pages = torch.gather(page_table.long(), 1, torch.div(positions, page_size, rounding_mode="floor"))
    return pages * page_size + positions % page_size


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Copies of whole pages (``pages``: any shape of page ids), as ``[*pages.shape, page elements]``.

    Indexing the pool as a 2-D ``[num_pages, page elements]`` matrix makes ``index_select`` a plain row memcpy;
    ``cache[pages]`` on the 4-D tensor runs the generic indexing kernel, 2-6x slower on the CPU.
    """
    rows = cache.view(cache.shape[0], -1)
    return torch.index_select(rows, 0, pages.reshape(-1)).view(*pages.shape, rows.shape[1])


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """True where a query at ``q_pos`` may attend a key at ``k_pos`` (causal, optional sliding window)."""
    allowed = k_pos <= q_pos
    if sliding_window > 0:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def _extend_bias(prefix: int, extend: int, group: int, sliding_window: int, dtype: torch.dtype,
                 device: torch.device, cache: dict | None) -> torch.Tensor:
    """The additive mask (0 / -inf, ``[1, 1, group * extend, prefix + extend]``) of one request's extend."""
    key = ("extend-bias", prefix, extend, group, sliding_window, dtype)
    if cache is not None and key in cache:
        return cache[key]
    q_pos = (prefix + torch.arange(extend, device=device)).repeat(group)
    allowed = _window_mask(q_pos[:, None], torch.arange(prefix + extend, device=device)[None, :], sliding_window)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))[None, None]
    if cache is not None:
        cache[key] = bias
    return bias


def decode_metadata(
    page_table: torch.Tensor, seq_lens: torch.Tensor, sliding_window: int = 0, page_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`decode_attention` derives from the batch alone, the same for every layer: compute it once
    per forward and pass it as ``meta``. Returns (the page table as int64 ``[B, pages]``, the keys each query
    may attend ``[B, 1, 1, pages * page_size]`` bool)."""
    if page_size is None:
        raise ValueError("decode_metadata needs the page size")
    seq_lens = seq_lens.long()
    pages = page_table.long()
    max_len = pages.shape[1] * page_size
    positions = torch.arange(max_len, device=pages.device)[None, :]
    allowed = positions < seq_lens[:, None]
    if sliding_window > 0:
        allowed &= positions > seq_lens[:, None] - 1 - sliding_window
    return pages, allowed[:, None, None, :]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor | None,
    sm_scale: float,
    sliding_window: int = 0,
    meta: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query token per request (``q``: ``[B, heads, head_dim]``) over ragged paged histories.

    ``seq_lens[r]`` counts request r's keys, the current token included (unused when ``meta`` is given).
    Returns ``[B, heads, head_dim]``.
    K/V are gathered a whole page at a time (contiguous ``page_size * kv_heads * head_dim`` blocks, no
    per-token index math) and read by SDPA through a strided view, without a second copy; positions past a
    request's length (the rest of its last page, the padding of the page table) are masked out.
    """
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    pages, allowed = meta if meta is not None else decode_metadata(page_table, seq_lens, sliding_window, page_size)
    max_len = pages.shape[1] * page_size
    keys = gather_pages(k_cache, pages).view(batch, max_len, kv_heads, head_dim).transpose(1, 2)  # [B, KH, L, D]
    values = gather_pages(v_cache, pages).view(batch, max_len, kv_heads, head_dim).transpose(1, 2)
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.view(batch, kv_heads, group, head_dim), keys, values, attn_mask=allowed, scale=sm_scale
    )
    return out.reshape(batch, heads, head_dim)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
    mask_cache: dict | None = None,
) -> torch.Tensor:
    """A chunk of new tokens per request attending to its cached prefix and causally to itself.

    ``q`` is ``[sum(extend_lens), heads, head_dim]``, requests back to back. Request r's new tokens sit at
    positions ``prefix_lens[r] ..  prefix_lens[r] + extend_lens[r] - 1`` and are already stored in the cache.
    ``mask_cache`` (a dict that lives for one forward) keeps the masks, which depend only on the lengths,
    from being rebuilt for every layer.
    """
    _, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    start = 0
    for r, (prefix, extend) in enumerate(zip(prefix_lens.tolist(), extend_lens.tolist())):
        if extend == 0:
            continue
        seq_len = prefix + extend
        pages = page_table[r, : -(-seq_len // page_size)].long()  # whole pages, then the first seq_len rows
        keys = gather_pages(k_cache, pages).view(-1, kv_heads, head_dim)[:seq_len].transpose(0, 1).to(q.dtype)
        values = gather_pages(v_cache, pages).view(-1, kv_heads, head_dim)[:seq_len].transpose(0, 1).to(q.dtype)
        q_r = q[start : start + extend]
        # 4-D inputs keep SDPA on its fused CPU kernel (3-D ones fall back to the unfused math path)
        if prefix == 0 and sliding_window == 0:  # plain causal: the kernel skips the blocks above the diagonal
            o = F.scaled_dot_product_attention(
                q_r.transpose(0, 1)[None], keys[None], values[None], is_causal=True, scale=sm_scale, enable_gqa=True
            )
            out[start : start + extend] = o[0].transpose(0, 1)
        else:  # the group's query heads of one kv head attend as one block: K/V are never repeated
            q_r = q_r.view(extend, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * extend, head_dim)
            bias = _extend_bias(prefix, extend, group, sliding_window, q.dtype, q.device, mask_cache)
            o = F.scaled_dot_product_attention(q_r[None], keys[None], values[None], attn_mask=bias, scale=sm_scale)
            out[start : start + extend] = o[0].view(kv_heads, group, extend, head_dim).permute(2, 0, 1, 3).reshape(
                extend, heads, head_dim
            )
        start += extend
    return out
