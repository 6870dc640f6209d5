"""CPU linear layers through oneDNN, with each weight reordered once into oneDNN's blocked layout.

``F.linear`` on the CPU calls MKL's sgemm, which repacks the weight on every call; at decode batch sizes
(1-64 rows) that repacking is a large share of the GEMM. A weight prepacked at load time (what inductor's
``mkldnn`` linear does) runs the same product 10-50% faster for those shapes, and the LM head's 49k-row GEMM
up to 1.8x faster (see docs/BENCHMARKS.md). oneDNN's bf16 kernels need AVX512-BF16/AMX or AVX-NE-CONVERT;
where the CPU lacks them the reorder fails and the layer keeps the plain path.

``RADIXRT_DISABLE_PACKED_LINEAR=1`` keeps every layer on ``F.linear``.
"""

from __future__ import annotations

import os

import torch

BATCH_HINT = 64  # the row count oneDNN tunes the blocked layout for; any row count works afterwards


def packing_enabled(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and os.environ.get("RADIXRT_DISABLE_PACKED_LINEAR") != "1"
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) in oneDNN's layout, or None where oneDNN has no kernel for its dtype here."""
    if not packing_enabled(weight.device):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    except RuntimeError:
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` as returned by :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
