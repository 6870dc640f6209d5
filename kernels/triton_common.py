"""Shared helpers of the Triton kernels: interpreter detection and the autotune guard.

Importing this module imports triton, so only the kernel modules import it (never ``triton_ops`` at
module level). ``TRITON_INTERPRET=1`` must be set before the kernel modules are imported for the
interpreter to take effect: ``triton_ops`` does that when no CUDA device exists.

On a GPU the kernels autotune (each new shape key compiles and times every config, a few seconds; the model runner
does it at start-up, and the timings are cached on disk);
``RADIXRT_TRITON_AUTOTUNE=0``, read at import, launches one fixed config instead (quick checks).
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl  # noqa: F401  (re-exported for the kernel modules)

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
# Autotuning benchmarks configs on a real device; the interpreter can run neither the timer nor the configs.
HAS_GPU_DRIVER: bool = (not INTERPRET) and torch.cuda.is_available()
AUTOTUNE_ENV = "RADIXRT_TRITON_AUTOTUNE"
AUTOTUNE: bool = HAS_GPU_DRIVER and os.environ.get(AUTOTUNE_ENV, "1") != "0"


def autotune(configs: list, key: list[str]):
    """``triton.autotune`` where a GPU driver exists and autotuning is on, else the identity (launchers then
    pass fixed tiles)."""
    if AUTOTUNE:
        # timings cached on disk next to triton's kernel cache: a restart does not tune again
        cached = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
        return triton.autotune(configs=configs, key=key, **cached)
    return lambda fn: fn


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tiles are upcast to fp32 before ``tl.dot``.

    Always in the interpreter (its bf16 arithmetic is wrong); on a GPU only for fp32 inputs, which then
    use IEEE fp32 products (no TF32) so the kernels match the fp32 reference to 1e-5.
    """
    return INTERPRET or dtype == torch.float32


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (to nearest even) and back to fp32: a rounding point of a kernel that
    must round where torch rounds. Written out for bf16 because triton's interpreter truncates that cast."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
