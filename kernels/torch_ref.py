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


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """True where a query at ``q_pos`` may attend a key at ``k_pos`` (causal, optional sliding window)."""
    allowed = k_pos <= q_pos
    if sliding_window > 0:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """One query token per request (``q``: ``[B, heads, head_dim]``) over ragged paged histories.

    ``seq_lens[r]`` counts request r's keys, the current token included. Returns ``[B, heads, head_dim]``.
    """
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    seq_lens = seq_lens.to(q.device).long()
    max_len = int(seq_lens.max())
    positions = torch.arange(max_len, device=q.device).expand(batch, max_len)
    valid = positions < seq_lens[:, None]
    slots = gather_slots(page_table, torch.where(valid, positions, 0), page_size)
    keys = k_cache.view(-1, kv_heads, head_dim)[slots].permute(0, 2, 1, 3)  # [B, KH, L, D]
    values = v_cache.view(-1, kv_heads, head_dim)[slots].permute(0, 2, 1, 3)
    allowed = valid & _window_mask(seq_lens[:, None] - 1, positions, sliding_window)
    out = F.scaled_dot_product_attention(
        q.view(batch, kv_heads, group, head_dim),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=allowed[:, None, None, :],
        scale=sm_scale,
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
) -> torch.Tensor:
    """A chunk of new tokens per request attending to its cached prefix and causally to itself.

    ``q`` is ``[sum(extend_lens), heads, head_dim]``, requests back to back. Request r's new tokens sit at
    positions ``prefix_lens[r] ..  prefix_lens[r] + extend_lens[r] - 1`` and are already stored in the cache.
    """
    _, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    start = 0
    for r, (prefix, extend) in enumerate(zip(prefix_lens.tolist(), extend_lens.tolist())):
        if extend == 0:
            continue
        seq_len = prefix + extend
        k_pos = torch.arange(seq_len, device=q.device)
        slots = gather_slots(page_table[r : r + 1], k_pos[None], page_size)[0]
        keys = flat_k[slots].transpose(0, 1).to(q.dtype)  # [KH, S, D]
        values = flat_v[slots].transpose(0, 1).to(q.dtype)
        q_r = q[start : start + extend].view(extend, kv_heads, group, head_dim)
        q_r = q_r.permute(1, 2, 0, 3).reshape(kv_heads, group * extend, head_dim)
        q_pos = (prefix + torch.arange(extend, device=q.device)).repeat(group)
        allowed = _window_mask(q_pos[:, None], k_pos[None, :], sliding_window)
        o = F.scaled_dot_product_attention(q_r, keys, values, attn_mask=allowed[None], scale=sm_scale)
        out[start : start + extend] = o.view(kv_heads, group, extend, head_dim).permute(2, 0, 1, 3).reshape(
            extend, heads, head_dim
        )
        start += extend
    return out
