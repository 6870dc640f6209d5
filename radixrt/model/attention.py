"""The attention-backend interface, and the choice of a backend by name.

An :class:`AttentionBackend` serves every attention layer of one model over one ``PagePool``. A layer calls
``q = backend.rope_and_store(layer, rotary, positions, q, k, v, batch)``: rotary embedding of ``q``/``k`` at
``positions``, and the new K/V (``[tokens, kv_heads, head_dim]``) stored into their slots (``batch.out_slots``)
of that layer's pages (a layer without rotary: ``backend.store_layer(layer, k, v, batch)``); then ``backend.attend_layer(layer, q, batch, sm_scale, sliding_window)``: the queries
(``[tokens, heads, head_dim]``) over each request's paged history, causal and within the sliding window
(0: none). A backend may fuse the first step into one kernel (the Triton backend does on a GPU); the default
rotates with the model's ``RotaryEmbedding`` and then calls ``store_kv``. ``backend(layer, q, k, v, ...)``
stores already-rotated K/V and attends (kernel tests). Two implement it:

* ``torch`` (:class:`~radixrt.model.torch_attention.TorchAttention`): torch with the C++ CPU kernels and
  the cascade over shared prefixes; the CPU path;
* ``triton`` (:class:`~radixrt.model.triton_attention.TritonAttention`): the Triton kernels; the GPU path
  (on the CPU only in triton's interpreter, for tests).

:func:`create_attention_backend` chooses once, when the model runner is built: ``auto`` is ``triton``
on a CUDA pool and ``torch`` elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from radixrt.memory.page_pool import PagePool
from radixrt.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixrt.model.layers import RotaryEmbedding

ATTENTION_BACKENDS = ("auto", "torch", "torch_native", "triton")  # torch_native: SGLang's name for torch


class AttentionBackend(ABC):
    """Stores a layer's new K/V in the page pool, then runs paged attention for a ``ForwardBatch``."""

    backend: ClassVar[str]  # the name it is chosen by: "torch" or "triton"

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool

    def rope_and_store(
        self,
        layer: int,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Rotate ``q`` and ``k`` at ``positions``, store ``k``/``v`` in ``layer``'s pages; the rotated ``q``."""
        q, k = rotary(positions, q, k)
        self.store_layer(layer, k, v, batch)
        return q

    def store_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
        """Store ``k``/``v`` as they are in ``layer``'s pages (a layer without rotary)."""
        self.store_kv(self.pool.k_caches[layer], self.pool.v_caches[layer], batch.out_slots, k, v)

    def attend_layer(
        self, layer: int, q: torch.Tensor, batch: ForwardBatch, sm_scale: float, sliding_window: int
    ) -> torch.Tensor:
        """``q`` over the pages of ``layer`` (the batch's new K/V already stored)."""
        return self.attend(q, self.pool.k_caches[layer], self.pool.v_caches[layer], batch, sm_scale, sliding_window)

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
        self.store_kv(k_cache, v_cache, batch.out_slots, k, v)
        return self.attend(q, k_cache, v_cache, batch, sm_scale, sliding_window)

    @abstractmethod
    def store_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``/``v`` (``[tokens, kv_heads, head_dim]``) into the given flat cache slots."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
        sliding_window: int,
    ) -> torch.Tensor:
        """The batch's queries over their requests' pages (the new K/V already stored)."""


def create_attention_backend(pool: PagePool, name: str = "auto", deterministic: bool = False) -> AttentionBackend:
    """The backend called ``name`` (one of :data:`ATTENTION_BACKENDS`) over ``pool``; ``deterministic``: one whose
    every token takes the same sums whatever its batch or its cached prefix (the torch backend on a CPU), else a
    ``ValueError``."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")
    if name == "auto":
        name = "triton" if pool.k_caches[0].device.type == "cuda" else "torch"
    if deterministic and (name == "triton" or pool.k_caches[0].device.type != "cpu"):
        raise ValueError("deterministic inference runs on the CPU's torch attention backend only; "
                         f"not on {name!r} over {pool.k_caches[0].device.type}")
    if name == "triton":
        from radixrt.model.triton_attention import TritonAttention

        return TritonAttention(pool)
    from radixrt.model.torch_attention import TorchAttention

    return TorchAttention(pool, all_rows=deterministic)
