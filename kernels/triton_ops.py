"""Triton paged attention: the GPU path, with exactly the entry points of :mod:`radixrt.kernels.torch_ref`.

Importing this module never needs triton (an optional extra: ``pip install 'radixrt[triton]'``); the
kernels are imported on first use. Kernels launch on the device of their tensors. Without a CUDA device
triton can only run in its interpreter, so first use then sets ``TRITON_INTERPRET=1`` (unless the
caller chose otherwise) before the kernel modules are imported: CPU tensors work there, slowly; that is
what the tests use.

- :func:`store_kv`: one launch writes the batch's new K/V into their (page, offset) slots.
- :func:`decode_attention`: one query per request, GQA-packed, split-KV (flash-decoding) + a merge kernel.
- :func:`extend_attention`: new chunks over their cached prefix pages and causally over themselves.
- :func:`rms_norm`, :func:`silu_and_mul`, :func:`rope_and_store`: a layer's fused element-wise steps, with
  the signatures of their torch twins in :mod:`radixrt.kernels.torch_fused`.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

AVAILABLE: bool = importlib.util.find_spec("triton") is not None

_modules: dict[str, ModuleType] = {}


def _kernel_module(name: str) -> ModuleType:
    if name not in _modules:
        if not AVAILABLE:
            raise ImportError("the triton attention backend needs triton: pip install 'radixrt[triton]'")
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        import importlib

        _modules[name] = importlib.import_module(f"radixrt.kernels.{name}")
    return _modules[name]


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write ``k``/``v`` (``[tokens, kv_heads, head_dim]``) into the given flat cache slots."""
    _kernel_module("triton_store").store_kv(k_cache, v_cache, slots, k, v)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """One query token per request (``q``: ``[B, heads, head_dim]``) over ragged paged histories."""
    return _kernel_module("triton_decode").decode_attention(
        q, k_cache, v_cache, page_table, seq_lens, sm_scale, sliding_window
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """A chunk of new tokens per request attending to its cached prefix and causally to itself
    (``max_extend_len``: the longest chunk, if the caller knows it without reading the device)."""
    return _kernel_module("triton_extend").extend_attention(
        q, k_cache, v_cache, page_table, prefix_lens, extend_lens, sm_scale, sliding_window,
        max_extend_len=max_extend_len,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` (with ``residual``: of ``x + residual``, written into ``residual``)."""
    return _kernel_module("triton_fused").rms_norm(x, weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[T, 2I]`` gate/up projection."""
    return _kernel_module("triton_fused").silu_and_mul(gate_up)


def rope_and_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``q`` in place (returned); rotate ``k`` and store it with ``v`` into ``slots`` (< 0: skipped)."""
    return _kernel_module("triton_fused").rope_and_store(positions, q, k, v, cos, sin, slots, k_cache, v_cache)
