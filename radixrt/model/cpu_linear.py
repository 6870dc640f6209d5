"""CPU linear layers with each weight packed once, at load time, for the kernel that runs it fastest here.

``F.linear`` on the CPU calls MKL's sgemm, which repacks the weight on every call; at decode batch sizes
(1-64 rows) that repacking is a large share of the GEMM. Two kernels take a weight packed once instead:

- ``panels`` (radixrt.kernels' ``linear_panels``): fp32 on CPUs with AVX2/FMA and no AVX-512, and on AMD's
  family 25 (Zen 4) with it, the weight in panels of 16 output columns that each thread streams once per block
  of rows. On an AVX2-only EPYC it ran 15-40% faster than oneDNN's prepacked kernel at every row count from 1 to
  2048; on Zen 4, whose 512-bit vectors run on 256-bit units, 1.5x faster at 1-2 rows and 0.91-1.15x from 4
  to 512 rows (docs/BENCHMARKS.md). It computes a row the same way whatever rows come with it, which
  oneDNN does not promise. Intel's AVX-512 CPUs keep oneDNN: on a Xeon with AMX oneDNN ran 1.25-1.8x the panel
  kernel from 16 rows on, the panels 1.27x oneDNN at one row.
- ``bf16`` (radixrt.kernels' ``linear_bf16``): bf16 on CPUs with AVX512-BF16 and no AMX, the weight in panels
  of 16 output columns as bf16 pairs, multiplied with ``vdpbf16ps`` in tiles of 8 rows by 3 panels. On an AMD
  EPYC (Zen 4) it ran 1.05-2x faster than oneDNN's prepacked bf16 kernel from 1 to 2048 rows, most at decode
  sizes (docs/BENCHMARKS.md).
- ``amx`` (radixrt.kernels' ``linear_amx``): bf16 on CPUs with AMX, the same panels read as AMX B tiles, 32 rows
  by 2 panels a step. On a Xeon with AMX (2 vCPUs, the default model's projections) it ran 1.2-1.5x oneDNN's
  prepacked kernel from 1 to 512 rows and 0.96x at 2,048 (prefill chunks). Every row gets the same bits whatever
  rows come with it (oneDNN's do not), so a speculative verify row gets its decode row's bits on these CPUs too.
  Input widths not a multiple of 32 keep oneDNN.
- ``fp8`` (radixrt.kernels' ``linear_fp8``): fp8 weights (``model/fp8.py``) of a bf16 model on CPUs with
  AVX512-BF16, one byte a weight in the bf16 kernel's panel layout with a scale per output and block of inputs,
  dequantized a panel group at a time into the bf16 kernel's tiles: each row gets the bits ``bf16`` gives it over
  the dequantized weight, from half the bytes. Elsewhere fp8 weights are dequantized once and packed as any other.
- ``onednn``: oneDNN's blocked layout (what inductor's ``mkldnn`` linear does), for everything else. Its bf16
  kernels need AVX512-BF16/AMX or AVX-NE-CONVERT; where the CPU lacks them the reorder fails and the layer
  keeps ``F.linear``.

Deterministic inference (``row_invariant``) takes radixrt's own kernels wherever they run, faster or not:
``panels`` for fp32, ``amx`` or ``bf16`` for bf16; a CPU with none of them for the dtype is refused.

``RADIXRT_CPU_LINEAR=onednn|panels|bf16|amx`` forces one kernel where it can run (``panels``: fp32, built with
AVX2; ``bf16``: bf16 weights with an even ``in``, built with AVX512-BF16; ``amx``: bf16 weights with ``in`` a
multiple of 32, built for and run on a CPU with AMX-BF16); ``RADIXRT_DISABLE_PACKED_LINEAR=1`` keeps
every layer on ``F.linear``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixrt.kernels import cpu_kernels

BATCH_HINT = 64  # the row count oneDNN tunes its blocked layout for; any row count works afterwards
KERNEL_ENV = "RADIXRT_CPU_LINEAR"
KERNELS = ("panels", "bf16", "amx", "onednn")  # forced by RADIXRT_CPU_LINEAR; fp8 weights take "fp8" by themselves


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out, in]`` packed for ``kernel`` (one of :data:`KERNELS`, or ``fp8``: then ``data`` holds the
    fp8 panels, ``scales`` their scales, input ``k``'s that of block ``(k_offset + k) // block_k``)."""

    data: torch.Tensor
    out_features: int
    kernel: str
    scales: torch.Tensor | None = None
    block_k: int = 0
    k_offset: int = 0


def packing_enabled(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("RADIXRT_DISABLE_PACKED_LINEAR") != "1"


def prefers_panels(flags: frozenset[str], model: tuple[str, int] = ("", 0)) -> bool:
    """AVX2 with FMA, without AVX-512 or on AMD's family 25 (Zen 4, which splits 512-bit vectors into halves):
    where the panel kernel beat oneDNN. ``model``: (vendor, family), as :func:`cpu_kernels.cpu_model`."""
    return {"avx2", "fma"} <= flags and ("avx512f" not in flags or model == ("AuthenticAMD", 25))


def prefers_bf16_panels(flags: frozenset[str]) -> bool:
    """AVX512-BF16 without AMX: where the bf16 panel kernel beat oneDNN (with AMX oneDNN has the tiles)."""
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def prefers_amx(flags: frozenset[str]) -> bool:
    """AMX-BF16: bf16 products on radixrt's AMX kernel."""
    return "amx_bf16" in flags


def choose_kernel(weight: torch.Tensor, row_invariant: bool = False) -> str:
    """The kernel that runs ``weight`` here: ``panels`` for fp32, ``amx`` or ``bf16`` for bf16 where preferred (or
    forced) and usable, else ``onednn``. With ``row_invariant``, one of radixrt's kernels wherever one runs the
    weight here (each computes a row the same way whatever rows come with it), else a ``ValueError``."""
    forced = os.environ.get(KERNEL_ENV)
    if forced is not None and forced not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={forced!r}; choose one of {', '.join(KERNELS)}")
    if row_invariant:
        return _row_invariant_kernel(weight)
    flags = cpu_kernels.cpu_flags()
    wants_panels = forced == "panels" or (forced is None and prefers_panels(flags, cpu_kernels.cpu_model()))
    if wants_panels and weight.dtype == torch.float32 and cpu_kernels.linear_panels_usable():
        return "panels"
    wants_amx = forced == "amx" or (forced is None and prefers_amx(flags))
    if (wants_amx and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 32 == 0
            and cpu_kernels.linear_amx_usable()):
        return "amx"
    wants_bf16 = forced == "bf16" or (forced is None and prefers_bf16_panels(flags))
    if (wants_bf16 and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0
            and cpu_kernels.linear_bf16_built()):
        return "bf16"
    return "onednn"


def _row_invariant_kernel(weight: torch.Tensor) -> str:
    fits_pairs = weight.dim() == 2 and weight.shape[1] % 2 == 0
    if weight.dtype == torch.float32 and cpu_kernels.linear_panels_usable():
        return "panels"
    if weight.dtype == torch.bfloat16 and fits_pairs and weight.shape[1] % 32 == 0 and cpu_kernels.linear_amx_usable():
        return "amx"
    if weight.dtype == torch.bfloat16 and fits_pairs and cpu_kernels.linear_bf16_built():
        return "bf16"
    needs = {torch.float32: "radixrt's fp32 panel kernel (AVX2 with FMA)",
             torch.bfloat16: "radixrt's bf16 kernels (AVX512-BF16 or AMX)"}
    needs = needs.get(weight.dtype, "a float32 or bfloat16 model")
    raise ValueError(f"deterministic inference needs {needs} for a {weight.dtype} weight of shape "
                     f"{tuple(weight.shape)}, and this CPU or build has none: try --dtype float32")


def pack_weight(weight: torch.Tensor, row_invariant: bool = False) -> PackedWeight | None:
    """``weight`` (``[out, in]``) packed for this CPU's kernel, or None where no kernel runs its dtype here. With
    ``row_invariant`` (deterministic inference) the kernel is one of radixrt's, else a ``ValueError``."""
    if not packing_enabled(weight.device):
        if row_invariant:
            raise ValueError("deterministic inference needs the packed linear layers "
                             "(RADIXRT_DISABLE_PACKED_LINEAR=1 turns them off)")
        return None
    kernel = choose_kernel(weight, row_invariant)
    if kernel == "panels":
        return PackedWeight(cpu_kernels.pack_linear_panels(weight), weight.shape[0], "panels")
    if kernel in ("bf16", "amx"):  # the same panels
        return PackedWeight(cpu_kernels.pack_linear_bf16(weight), weight.shape[0], kernel)
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT), weight.shape[0],
                            "onednn")
    except RuntimeError:
        return None


def pack_fp8_weight(bits: torch.Tensor, scales: torch.Tensor, block_k: int, k_offset: int,
                    dtype: torch.dtype) -> PackedWeight | None:
    """An fp8 weight (``model/fp8.py``'s bits and per-row scales) packed for ``linear_fp8``, or None where it does not
    run here: a model dtype other than bf16, an odd ``in``, packing off, a kernel other than ``bf16`` forced by
    ``RADIXRT_CPU_LINEAR``, or a build without AVX512-BF16 (where the bf16 panels do not run either)."""
    if (not packing_enabled(bits.device) or dtype != torch.bfloat16 or bits.shape[1] % 2 or block_k % 2
            or k_offset % 2 or os.environ.get(KERNEL_ENV) not in (None, "bf16") or not cpu_kernels.linear_bf16_built()):
        return None
    panels, panel_scales = cpu_kernels.pack_linear_fp8(bits, scales)
    return PackedWeight(panels, bits.shape[0], "fp8", panel_scales, block_k, k_offset)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None,
                  fp32_out: bool = False) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` as returned by :func:`pack_weight`; with ``fp32_out``, the result widened to
    fp32 (what ``.float()`` of it gives: the AMX kernel writes it so in its one pass, at 40 rows of an LM head
    half a millisecond less than widening after)."""
    if packed.kernel == "amx":
        return cpu_kernels.linear_amx(x, packed.data, packed.out_features, bias, fp32_out)
    if packed.kernel == "panels":
        out = cpu_kernels.linear_panels(x, packed.data, packed.out_features, bias)
    elif packed.kernel == "bf16":
        out = cpu_kernels.linear_bf16(x, packed.data, packed.out_features, bias)
    elif packed.kernel == "fp8":
        out = cpu_kernels.linear_fp8(x, packed.data, packed.scales, packed.block_k, packed.k_offset,
                                     packed.out_features, bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    return out.float() if fp32_out else out
