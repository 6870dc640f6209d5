"""CPU linear layers with each weight packed once, at load time, for the kernel that runs it fastest here.

``F.linear`` on the CPU calls MKL's sgemm, which repacks the weight on every call; at decode batch sizes
(1-64 rows) that repacking is a large share of the GEMM. Two kernels take a weight packed once instead:

- ``panels`` (radixrt.kernels' ``linear_panels``): fp32 on CPUs with AVX2/FMA and no AVX-512, the weight in
  panels of 16 output columns that each thread streams once per block of rows. On such a CPU it ran 15-40%
  faster than oneDNN's prepacked kernel at every row count from 1 to 2048 (docs/BENCHMARKS.md).
- ``onednn``: oneDNN's blocked layout (what inductor's ``mkldnn`` linear does), for everything else. Its bf16
  kernels need AVX512-BF16/AMX or AVX-NE-CONVERT; where the CPU lacks them the reorder fails and the layer
  keeps ``F.linear``.

``RADIXRT_CPU_LINEAR=onednn|panels`` forces one kernel (``panels`` where it can run: fp32, built with AVX2);
``RADIXRT_DISABLE_PACKED_LINEAR=1`` keeps every layer on ``F.linear``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixrt.kernels import cpu_kernels

BATCH_HINT = 64  # the row count oneDNN tunes its blocked layout for; any row count works afterwards
KERNEL_ENV = "RADIXRT_CPU_LINEAR"
KERNELS = ("panels", "onednn")


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out, in]`` packed for ``kernel`` (one of :data:`KERNELS`)."""

    data: torch.Tensor
    out_features: int
    kernel: str


def packing_enabled(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("RADIXRT_DISABLE_PACKED_LINEAR") != "1"


def prefers_panels(flags: frozenset[str]) -> bool:
    """AVX2 with FMA and no AVX-512: where the panel kernel beat oneDNN (with AVX-512 oneDNN has wider vectors)."""
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


def choose_kernel(weight: torch.Tensor) -> str:
    """The kernel that runs ``weight`` here: ``panels`` for fp32 where it is preferred (or forced) and built."""
    forced = os.environ.get(KERNEL_ENV)
    if forced is not None and forced not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={forced!r}; choose one of {', '.join(KERNELS)}")
    wants_panels = forced == "panels" or (forced is None and prefers_panels(cpu_kernels.cpu_flags()))
    if wants_panels and weight.dtype == torch.float32 and cpu_kernels.linear_panels_usable():
        return "panels"
    return "onednn"


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` (``[out, in]``) packed for this CPU's kernel, or None where no kernel runs its dtype here."""
    if not packing_enabled(weight.device):
        return None
    if choose_kernel(weight) == "panels":
        return PackedWeight(cpu_kernels.pack_linear_panels(weight), weight.shape[0], "panels")
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT), weight.shape[0],
                            "onednn")
    except RuntimeError:
        return None


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` as returned by :func:`pack_weight`."""
    if packed.kernel == "panels":
        return cpu_kernels.linear_panels(x, packed.data, packed.out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
