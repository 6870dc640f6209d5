"""Norms and rotary position embeddings, numerically identical to the transformers reference."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    """RoPE with the config's theta and scaling; cos/sin are precomputed in fp32 for every position."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, heads, D]`` and ``k`` ``[T, kv_heads, D]`` at ``positions`` ``[T]``."""
        cos = self.cos_cache[positions].to(q.dtype)[:, None, :]
        sin = self.sin_cache[positions].to(q.dtype)[:, None, :]
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
