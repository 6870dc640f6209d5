"""Norms, rotary position embeddings and the gated activation, numerically as the transformers reference.

Each runs as one fused kernel: on the CPU a C++ op where the kernels are built (kernels/cpu_kernels), on CUDA a
Triton kernel (kernels/triton_fused); elsewhere as their torch twins (kernels/torch_fused), which round at the
same points.
"""

from __future__ import annotations

import torch
from torch import nn

from radixrt.kernels import cpu_kernels, torch_fused, triton_ops
from radixrt.model.module import InferenceModule


def _kernels_for(x: torch.Tensor) -> bool:
    """Whether the C++ ops can run on ``x``'s device here (a CPU tensor, kernels built)."""
    return x.device.type == "cpu" and cpu_kernels.load() is not None


def triton_for(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels run on ``x``: a CUDA tensor, triton installed."""
    return x.is_cuda and triton_ops.AVAILABLE


def _fused_rows(x: torch.Tensor) -> bool:
    """Whether a C++ row op can take ``x``: rows with contiguous elements, on a device the kernels run on."""
    return x.dim() == 2 and x.stride(1) == 1 and _kernels_for(x)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, tanh approximation) * up`` of a merged ``[T, 2I]`` gate/up projection (Gemma's MLP), rounded
    where transformers rounds: the activation, then the product, each in the activations' dtype."""
    if _fused_rows(gate_up):
        return cpu_kernels.gelu_tanh_and_mul(gate_up)
    return torch_fused.gelu_tanh_and_mul(gate_up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[T, 2I]`` gate/up projection."""
    if triton_for(gate_up) and gate_up.stride(-1) == 1:
        return triton_ops.silu_and_mul(gate_up)
    if _fused_rows(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    return torch_fused.silu_and_mul(gate_up)


class RMSNorm(InferenceModule):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1 and x.dtype == self.weight.dtype and triton_for(x):
            return triton_ops.rms_norm(x, self.weight, self.eps)
        if _fused_rows(x) and x.dtype == self.weight.dtype:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        return torch_fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of ``x + residual``, ``x + residual``); the fused ops update ``residual`` in place."""
        if x.dim() == 2 and x.stride(1) == 1 and residual.is_contiguous() \
                and x.dtype == residual.dtype == self.weight.dtype and triton_for(x):
            return triton_ops.rms_norm(x, self.weight, self.eps, residual), residual
        if _fused_rows(x) and residual.is_contiguous() and x.dtype == residual.dtype == self.weight.dtype:
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = x + residual
        return self.forward(residual), residual


class RoundOnceRMSNorm(InferenceModule):
    """RMSNorm as Gemma (``weight_offset`` 1, weights stored as offsets from one) and OLMo 2 (``weight_offset`` 0)
    compute it: ``norm(x) * (weight_offset + weight)`` in fp32, rounded once (Llama's rounds the normalised x
    first). Over the last dimension of ``x``: a layer's ``[T, H]``, a projection's strided columns, or heads
    ``[T, heads, D]``."""

    def __init__(self, size: int, eps: float, weight_offset: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if weight_offset else torch.ones(size), requires_grad=False)
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and _kernels_for(x):
            rows = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, x.shape[-1])
            return cpu_kernels.rms_norm(rows, self.weight, self.eps, round_once=True,
                                        weight_offset=self.weight_offset).view(x.shape)
        return torch_fused.rms_norm_round_once(x, self.weight, self.eps, self.weight_offset)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class RotaryEmbedding(InferenceModule):
    """RoPE with the config's theta and scaling; cos/sin are precomputed in fp32, one table row a position.

    ``rotary_dim``: the tables' width, each head's first ``rotary_dim`` elements rotate; below ``head_dim``
    (``partial_rotary_factor`` < 1, Phi-4-mini) the rest of each head passes unrotated, as transformers' Phi-3.

    LongRoPE (``rope_type`` longrope: Phi-3.5, Phi-3 128k, Phi-4-mini) has two sets of frequencies: short ones for
    a sequence within the model's original context (``original_max_position_embeddings``, kept as ``long_from``),
    long ones for a longer sequence, at every position. transformers rotates a longer prompt long throughout, and
    its Phi-3 generation computes a sequence that outgrows the original context again from the start, long; the
    scheduler does the same (``Req.long_rope``, set at the prompt or when the sequence outgrows it). The tables
    hold the short rows for positions below ``long_from``, then the long rows, the long row of position p at
    ``long_from + p``; ``ForwardBatch.build`` maps each token to its row (``rope_table_rows``).

    The tables are computed on the CPU (the same numbers whatever the device), then placed on the device
    the module is built on (the ambient default device, ``with torch.device(...)``).
    """

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        """``layer_type``: the layer kind whose parameters to use where the config keeps one set per kind (Gemma 3's
        ``rope_parameters`` for ``sliding_attention`` and ``full_attention``)."""
        super().__init__()
        params = dict(getattr(config, "rope_parameters", None) or {})
        if layer_type is not None:
            params = dict(params[layer_type])
        rope_type = params.get("rope_type", "default")
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        self.rotary_dim = int(head_dim * partial)
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {partial} of head_dim {head_dim} gives a rotary dim of "
                             f"{self.rotary_dim}: it must be even and within the head")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        cpu = torch.device("cpu")
        kind = {} if layer_type is None else {"layer_type": layer_type}
        self.long_from: int | None = None
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = self.rotary_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=cpu) / dim))
            cos, sin = _tables(inv_freq, max_positions, 1.0)
        elif rope_type == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            original = int(params["original_max_position_embeddings"])
            short, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu, **kind)
            cos, sin = _tables(short, min(original, max_positions), scaling)
            if max_positions > original:  # else no sequence here outgrows the original context
                self.long_from = original
                long, _ = ROPE_INIT_FUNCTIONS[rope_type](config, cpu, seq_len=original + 1, **kind)
                long_cos, long_sin = _tables(long, max_positions, scaling)
                cos, sin = torch.cat((cos, long_cos)), torch.cat((sin, long_sin))
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu, **kind)
            cos, sin = _tables(inv_freq, max_positions, scaling)
        device = torch.get_default_device()
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def fp32_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin as fp32 for the fused op, also after the model was cast to bf16/fp16 (which rounds them
        exactly as the reference does; the op rounds them to the activations' dtype again, a no-op)."""
        if self.cos_cache.dtype == torch.float32:
            return self.cos_cache, self.sin_cache
        if getattr(self, "_fp32", None) is None or self._fp32[0].device != self.cos_cache.device:
            self._fp32 = (self.cos_cache.float(), self.sin_cache.float())
        return self._fp32

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, heads, D]`` and ``k`` ``[T, kv_heads, D]`` at ``positions`` ``[T]`` (rows of the
        tables: ``ForwardBatch.positions``).

        The fused CPU op rotates them in place (they are views into the QKV projection's output).
        """
        if all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k)) and _kernels_for(q):
            cpu_kernels.rotary_embedding(positions, q, k, *self.fp32_caches())
            return q, k
        return torch_fused.rotary(positions, q, k, self.cos_cache, self.sin_cache)


def long_rope_from(model: nn.Module) -> int | None:
    """A LongRoPE model's original context (its rotary tables' ``long_from``); None for any other model."""
    values = {m.long_from for m in model.modules() if isinstance(m, RotaryEmbedding)}
    if len(values) > 1:
        raise ValueError(f"rotary embeddings with different original contexts ({sorted(map(str, values))}) are not "
                         "supported")
    return values.pop() if values else None


def _tables(inv_freq: torch.Tensor, positions: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin rows of positions ``0 .. positions - 1``, as transformers computes them: ``cat(freqs, freqs)``
    of ``position * inv_freq``, times the attention scaling."""
    cpu = torch.device("cpu")
    freqs = torch.arange(positions, dtype=torch.float, device=cpu)[:, None] * inv_freq.to(cpu).float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
