"""The Triton attention backend: the GPU path, :mod:`radixrt.kernels.triton_ops`.

Rotary embedding and the K/V store are one kernel (``rope_and_store``). A decode batch runs the split-KV decode
kernel; any other batch (prefill, extend over a cached prefix, mixed) runs the extend kernel. Choosing it needs no triton; the first call does (``triton_ops`` imports
the kernels on first use, in triton's interpreter when there is no CUDA device).
"""

from __future__ import annotations

import torch

from radixrt.kernels import triton_ops
from radixrt.model.attention import AttentionBackend
from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.layers import RotaryEmbedding


class TritonAttention(AttentionBackend):
    backend = "triton"
    store_kv = staticmethod(triton_ops.store_kv)

    def rope_and_store(self, layer: int, rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return triton_ops.rope_and_store(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, batch.out_slots,
                                         self.pool.k_caches[layer], self.pool.v_caches[layer])

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, sm_scale: float,
               sliding_window: int) -> torch.Tensor:
        if batch.is_decode:
            return triton_ops.decode_attention(
                q, k_cache, v_cache, batch.page_table, batch.seq_lens, sm_scale, sliding_window
            )
        return triton_ops.extend_attention(
            q, k_cache, v_cache, batch.page_table, batch.prefix_lens, batch.extend_lens, sm_scale, sliding_window,
            max_extend_len=batch.max_extend_len or None,
        )
