"""Every environment variable radixrt reads, in one registry: its name, default and meaning.

``radixrt env`` prints them with the values this process sees. Code in ``radixrt/`` reads them through ``get``
(a name not registered here is a KeyError, so a typo cannot silently read nothing); the kernels, which import
nothing of the runtime, read theirs from ``os.environ`` under the names registered here, and
``tests/test_env.py`` checks that every ``RADIXRT_*`` name in the source is one of them. Imports nothing of the
runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None  # None: unset means "not given"
    meaning: str


VARIABLES: dict[str, EnvVar] = {v.name: v for v in [
    EnvVar("RADIXRT_CACHE", "~/.cache/radixrt", "where models are downloaded and converted"),
    EnvVar("RADIXRT_API_KEY", None, "the server's API key (as --api-key)"),
    EnvVar("RADIXRT_ADMIN_API_KEY", None, "the key of the server's admin routes (as --admin-api-key)"),
    EnvVar("RADIXRT_AUTO_DTYPE", None, "what --dtype auto resolves to on every device: float32 or bfloat16 "
           "(unset: bf16 on CUDA and on CPUs with AMX or AVX512-BF16, else fp32)"),
    EnvVar("RADIXRT_DISABLE_CPU_KERNELS", "0", "1: no C++ CPU kernels (the torch path runs)"),
    EnvVar("RADIXRT_CPU_VECTORS", None, "build the C++ CPU kernels for narrower vectors than the CPU has "
           "(avx2, avx512)"),
    EnvVar("RADIXRT_CPU_LINEAR", None, "the packed CPU linear kernel: panels, bf16, amx or onednn (unset: by CPU "
           "and dtype)"),
    EnvVar("RADIXRT_ENGINE_SCHEDULER", None, "where an Engine left at engine_scheduler=auto runs its scheduler: "
           "thread or process (unset: process on CUDA, thread on a CPU)"),
    EnvVar("RADIXRT_DISABLE_PACKED_LINEAR", "0", "1: CPU linear layers run F.linear on unpacked weights"),
    EnvVar("RADIXRT_DISABLE_MALLOC_TUNING", "0", "1: leave glibc's allocator settings alone"),
    EnvVar("RADIXRT_TILED_ROWS_NEW", "512", "new tokens a request up to which a prefill chunk attends as decode rows "
           "where the CPU's decode kernel multiplies on AMX tiles (bf16); 0: up to 16, as on other CPUs"),
    EnvVar("RADIXRT_TRITON_AUTOTUNE", "1", "0: Triton kernels launch one fixed config instead of autotuning"),
    EnvVar("RADIXRT_TORCH_PROFILER_DIR", None, "where the server's /start_profile writes traces when the request "
           "names no folder (unset: SGLANG_TORCH_PROFILER_DIR, else /tmp)"),
    EnvVar("SGLANG_TORCH_PROFILER_DIR", None, "SGLang's name for RADIXRT_TORCH_PROFILER_DIR, read after it"),
]}


def get(name: str) -> str | None:
    """The variable's value, or its default when unset."""
    var = VARIABLES[name]
    return os.environ.get(name, var.default)


def flag(name: str) -> bool:
    """A switch: "1" is on."""
    return get(name) == "1"


def describe() -> str:
    """The registry as text, with the values this process sees: what ``radixrt env`` prints."""
    lines = []
    for var in VARIABLES.values():
        value = os.environ.get(var.name)
        shown = "***" if value and "KEY" in var.name else value
        now = f"set to {shown!r}" if value is not None else f"unset (default: {var.default or 'none'})"
        lines.append(f"{var.name}\n    {var.meaning}\n    {now}")
    return "\n".join(lines)
