"""The attention backend: stores a layer's new K/V in the page pool, then runs paged attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.kernels import cpu_kernels, torch_cascade, torch_ref
from radixrt.memory.page_pool import PagePool
from radixrt.model.forward_batch import ForwardBatch

ATTENTION_BACKENDS = ("auto", "torch", "triton")


class PagedAttention:
    def __init__(self, pool: PagePool, backend: str = "auto") -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
        device = pool.k_caches[0].device
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        self.pool = pool
        self.backend = backend
        if backend == "triton":
            from radixrt.kernels import triton_ops

            self.ops = triton_ops
        else:
            self.ops = torch_ref

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
        sliding_window: int,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_caches[layer], self.pool.v_caches[layer]
        self.ops.store_kv(k_cache, v_cache, batch.out_slots, k, v)
        if self.ops is torch_ref:
            return self._torch_attention(q, k_cache, v_cache, batch, sm_scale, sliding_window)
        if batch.is_decode:
            return self.ops.decode_attention(
                q, k_cache, v_cache, batch.page_table, batch.seq_lens, sm_scale, sliding_window
            )
        return self.ops.extend_attention(
            q, k_cache, v_cache, batch.page_table, batch.prefix_lens, batch.extend_lens, sm_scale, sliding_window
        )

    @staticmethod
    def _torch_attention(q, k_cache, v_cache, batch: ForwardBatch, sm_scale: float, sliding_window: int) -> torch.Tensor:
        """The CPU path. Requests of a mixed batch that decode one token take the batched decode path (and its
        cascade); attending one query per request through the extend loop costs a whole gather and call each."""
        if batch.is_decode:
            return _torch_decode(q, k_cache, v_cache, batch.page_table, batch.seq_lens, batch.attn_cache,
                                 ("decode", sliding_window), sm_scale, sliding_window)
        split = batch.attn_cache.get("mixed")
        if split is None:
            split = batch.attn_cache["mixed"] = MixedSplit.of(batch)
        if split.decode_reqs.numel() < MIN_DECODE_ROWS_TO_SPLIT:
            return _torch_extend(q, k_cache, v_cache, batch.page_table, batch.prefix_lens, batch.extend_lens,
                                 batch.attn_cache, ("extend", sliding_window), sm_scale, sliding_window)
        out = torch.empty_like(q)
        out[split.decode_tokens] = _torch_decode(
            q[split.decode_tokens], k_cache, v_cache, batch.page_table[split.decode_reqs],
            batch.seq_lens[split.decode_reqs], batch.attn_cache, ("mixed-decode", sliding_window), sm_scale,
            sliding_window,
        )
        out[split.extend_tokens] = _torch_extend(
            q[split.extend_tokens], k_cache, v_cache, batch.page_table[split.extend_reqs],
            batch.prefix_lens[split.extend_reqs], batch.extend_lens[split.extend_reqs], batch.attn_cache,
            ("mixed-extend", sliding_window), sm_scale, sliding_window,
        )
        return out


MIN_DECODE_ROWS_TO_SPLIT = 2


@dataclass
class MixedSplit:
    """A mixed batch's one-token requests (``decode_*``) and the rest (``extend_*``): request and token rows."""

    decode_reqs: torch.Tensor
    decode_tokens: torch.Tensor
    extend_reqs: torch.Tensor
    extend_tokens: torch.Tensor

    @classmethod
    def of(cls, batch: ForwardBatch) -> "MixedSplit":
        lens = batch.extend_lens.long().cpu()
        starts = torch.cumsum(lens, 0) - lens
        one = lens == 1
        decode_reqs, extend_reqs = torch.nonzero(one).flatten(), torch.nonzero(~one).flatten()
        token_is_decode = torch.repeat_interleave(one, lens)
        device = batch.extend_lens.device
        return cls(
            decode_reqs=decode_reqs.to(device),
            decode_tokens=starts[decode_reqs].to(device),
            extend_reqs=extend_reqs.to(device),
            extend_tokens=torch.nonzero(~token_is_decode).flatten().to(device),
        )


def _torch_decode(q, k_cache, v_cache, page_table, seq_lens, cache: dict, key, sm_scale: float,
                  sliding_window: int) -> torch.Tensor:
    # what the page table implies is the same for every layer: derive it once per forward
    plan = cache.get(key)
    page_size = k_cache.shape[1]
    if sliding_window == 0:
        if plan is None:
            plan = cache[key] = torch_cascade.plan_decode(page_table, seq_lens, page_size)
        return torch_cascade.cascade_decode_attention(q, k_cache, v_cache, plan, sm_scale)
    if cpu_kernels.usable_for(q, k_cache):
        return cpu_kernels.paged_decode(q, k_cache, v_cache, page_table, seq_lens, sm_scale, sliding_window)[0]
    if plan is None:
        plan = cache[key] = torch_ref.decode_metadata(page_table, seq_lens, sliding_window, page_size)
    return torch_ref.decode_attention(q, k_cache, v_cache, page_table, seq_lens, sm_scale, sliding_window, meta=plan)


def _torch_extend(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, cache: dict, key, sm_scale: float,
                  sliding_window: int) -> torch.Tensor:
    if sliding_window > 0:
        return torch_ref.extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, sm_scale,
                                          sliding_window, cache)
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = torch_cascade.plan_extend(page_table, prefix_lens, extend_lens, k_cache.shape[1])
    return torch_cascade.cascade_extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, plan,
                                                  sm_scale, cache)
