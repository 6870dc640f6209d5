"""Torch twins of the fused element-wise kernels (:mod:`radixrt.kernels.triton_fused`): the same results,
rounded to the activations' dtype where transformers' eager modules round. They are the reference the
kernels are tested against, and the path of a device that runs neither Triton nor the C++ CPU ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` (with ``residual``: of ``x + residual``, which is written into ``residual``)."""
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_round_once(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    """RMSNorm as Gemma (``weight_offset`` 1) and OLMo 2 (0) compute it: ``norm(x) * (weight_offset + weight)`` in
    fp32, rounded once to ``x``'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight.float() + weight_offset if weight_offset else weight.float()
    return (h * scale).to(x.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, tanh approximation) * up`` of a merged ``[T, 2I]`` gate/up projection (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[T, 2I]`` gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[T, heads, D]`` and ``k`` ``[T, kv_heads, D]`` rotated at ``positions``, rows of the tables
    ``[rows, R]`` (new tensors). ``R < D`` (a partial rotary): each head's first ``R`` elements rotate, the rest
    pass unchanged."""
    cos = cos_cache[positions].to(q.dtype)[:, None, :]
    sin = sin_cache[positions].to(q.dtype)[:, None, :]
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        q_rot, k_rot = rotary(positions, q[..., :rot], k[..., :rot], cos_cache, sin_cache)
        return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_and_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> torch.Tensor:
    """``q`` rotated in place (and returned); ``k`` rotated and stored with ``v`` into ``slots`` (< 0: skipped)."""
    q_rot, k_rot = rotary(positions, q, k, cos, sin)
    q.copy_(q_rot)
    keep = slots >= 0
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots[keep]] = k_rot[keep].to(k_cache.dtype)
    flat_v[slots[keep]] = v[keep].to(v_cache.dtype)
    return q
