"""The attention backend: stores a layer's new K/V in the page pool, then runs paged attention."""

from __future__ import annotations

import torch

from radixrt.kernels import torch_cascade, torch_ref
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
        if batch.is_decode:
            if self.ops is torch_ref:
                return self._torch_decode(q, k_cache, v_cache, batch, sm_scale, sliding_window)
            return self.ops.decode_attention(
                q, k_cache, v_cache, batch.page_table, batch.seq_lens, sm_scale, sliding_window
            )
        return self.ops.extend_attention(
            q, k_cache, v_cache, batch.page_table, batch.prefix_lens, batch.extend_lens, sm_scale, sliding_window
        )

    @staticmethod
    def _torch_decode(q, k_cache, v_cache, batch: ForwardBatch, sm_scale: float, sliding_window: int) -> torch.Tensor:
        # what the page table implies is the same for every layer: derive it once per forward
        key = ("decode", sliding_window)
        plan = batch.attn_cache.get(key)
        page_size = k_cache.shape[1]
        if sliding_window == 0:
            if plan is None:
                plan = batch.attn_cache[key] = torch_cascade.plan_decode(batch.page_table, batch.seq_lens, page_size)
            return torch_cascade.cascade_decode_attention(q, k_cache, v_cache, plan, sm_scale)
        if plan is None:
            plan = batch.attn_cache[key] = torch_ref.decode_metadata(
                batch.page_table, batch.seq_lens, sliding_window, page_size
            )
        return torch_ref.decode_attention(
            q, k_cache, v_cache, batch.page_table, batch.seq_lens, sm_scale, sliding_window, meta=plan
        )
