"""Keeps glibc from returning large tensor buffers to the kernel after every forward.

By default glibc serves allocations above 128 KiB (a threshold that grows only slowly) with a fresh
``mmap`` and unmaps them on free, so each forward's activations and K/V gathers page-fault their memory in
again: on a 2-core CPU that doubled the time of a batch-64 decode step. Raising the mmap threshold and the
trim threshold lets freed buffers stay in the heap and be reused (vLLM's CPU build gets the same effect by
preloading tcmalloc). The cost is that up to ``trim_bytes`` of freed memory stays mapped by the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit

_tuned = False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory(trim_bytes: int = 1 << 30, top_pad_bytes: int = 256 << 20) -> bool:
    """Apply the settings once per process; returns whether they are in effect.

    Does nothing off glibc Linux or when ``RADIXRT_DISABLE_MALLOC_TUNING=1``.
    """
    global _tuned
    if _tuned:
        return True
    if os.environ.get("RADIXRT_DISABLE_MALLOC_TUNING") == "1" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = (
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        and mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1
        and mallopt(_M_TOP_PAD, top_pad_bytes) == 1
    )
    _tuned = ok
    if not ok:
        logger.warning("mallopt refused the allocator settings; CPU forwards may be slower")
    return ok


def release_freed_memory() -> bool:
    """Give the kernel back the freed memory glibc still holds (``malloc_trim``), in every arena: what
    ``keep_freed_memory`` keeps for the next forward, returned where a process is done with those forwards (the
    test suite, after each module). Returns whether anything was released; False off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    return malloc_trim(0) == 1
