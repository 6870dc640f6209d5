"""C++ CPU kernels (kernels/csrc), compiled on first use with torch's JIT extension builder and cached.

``rms_norm`` (with the residual add fused in), ``silu_and_mul`` and ``rotary_embedding`` each replace a chain
of small torch ops of a decoder layer. ``paged_decode`` reads each request's K/V pages where they lie in the
pool: the torch path must first copy every request's whole history (``gather_pages``) and then read the copy
again, which at long contexts costs more than the attention itself. Build once: ``python -m radixrt.kernels.cpu_kernels`` (about 50 s with
gcc; later loads take well under a second). Where no compiler is found the runtime keeps the torch path
(a warning says why); ``RADIXRT_DISABLE_CPU_KERNELS=1`` keeps it deliberately.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("bindings.cpp", "paged_decode.cpp", "fused_ops.cpp")]


def enabled() -> bool:
    return os.environ.get("RADIXRT_DISABLE_CPU_KERNELS") != "1"


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _vector_flags(cpu_flags: str) -> list[str]:
    """Which of ATen's vector implementations (at::vec, used for exp) the kernels compile against."""
    names = set(cpu_flags.split())
    if {"avx2", "fma"} <= names:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def _build_name() -> str:
    """Sources, torch version and CPU flags in the name: ``-march=native`` code must not move between CPUs."""
    digest = hashlib.sha256(torch.__version__.encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(_cpu_flags().encode())
    return f"radixrt_cpu_{digest.hexdigest()[:12]}"


@lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled kernels, or None where they are disabled or cannot be built here."""
    if not enabled():
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension(
            name=_build_name(),
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *_vector_flags(_cpu_flags())],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch path still works
        logger.warning("CPU kernels unavailable, using the torch path: %s", str(exc).splitlines()[0])
        return None


def usable_for(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` can run on these tensors here (CPU, one dtype, kernels built)."""
    return q.device.type == "cpu" and q.dtype == k_cache.dtype and load() is not None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q`` ``[B, heads, D]`` over paged K/V read in place: (out, log-sum-exp fp32).

    ``page_table`` ``[B, W]`` and ``seq_lens`` ``[B]`` (each >= 1) are int32; q and the caches share a dtype.
    """
    out, lse = _module().paged_decode(q, k_cache, v_cache, page_table, seq_lens, float(sm_scale), int(sliding_window))
    return out, lse


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, H]``; with ``residual``, first ``residual += x`` in place and normalize that."""
    return _module().rms_norm(x, residual, weight, float(eps))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2I]`` holding gate then up."""
    return _module().silu_and_mul(gate_up)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> None:
    """Neox-style (rotate-half) RoPE of ``q`` ``[T, H, D]`` and ``k`` ``[T, KH, D]`` in place."""
    _module().rotary_embedding(positions, q, k, cos_cache, sin_cache)


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available here (see cpu_kernels.load)")
    return module


if __name__ == "__main__":
    print("built" if load() is not None else "not available (see the warning above)")
