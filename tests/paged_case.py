"""Random paged-attention cases and a dense, loop-per-request oracle (shared by torch and Triton tests)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D] (extend) or [B, H, D] (decode)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens: torch.Tensor
    keys: list[torch.Tensor]  # dense per request [S, KH, D]
    values: list[torch.Tensor]


def make_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    """Requests whose pages are scattered over the pool in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_needed = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_needed) + 3
    ids = list(range(num_pages))
    rng.shuffle(ids)
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    page_table = torch.zeros(len(seq_lens), max(pages_needed), dtype=torch.int32)
    keys, values = [], []
    for r, (s, n) in enumerate(zip(seq_lens, pages_needed)):
        mine = [ids.pop() for _ in range(n)]
        page_table[r, :n] = torch.tensor(mine, dtype=torch.int32)
        slots = torch.tensor([mine[p // page_size] * page_size + p % page_size for p in range(s)], dtype=torch.long)
        keys.append(k_cache.view(-1, kv_heads, head_dim)[slots])
        values.append(v_cache.view(-1, kv_heads, head_dim)[slots])
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=gen).to(dtype)
    return PagedCase(q, k_cache, v_cache, page_table, torch.tensor(prefix_lens, dtype=torch.int32),
                     torch.tensor(extend_lens, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), keys, values)


def dense_reference(case: PagedCase, sm_scale: float, sliding_window: int = 0) -> torch.Tensor:
    """Plain softmax attention per request, K/V repeated per query head, computed in fp64."""
    heads = case.q.shape[1]
    out = []
    start = 0
    for r, (prefix, extend) in enumerate(zip(case.prefix_lens.tolist(), case.extend_lens.tolist())):
        q = case.q[start : start + extend].double()
        start += extend
        group = heads // case.keys[r].shape[1]
        k = case.keys[r].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = case.values[r].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * sm_scale
        q_pos = prefix + torch.arange(extend)[:, None]
        k_pos = torch.arange(prefix + extend)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), v))
    return torch.cat(out)
