"""The allocator settings that keep CPU forwards from page-faulting their buffers in every step."""

import subprocess
import sys

import pytest

from radixrt.model.cpu_malloc import keep_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_settings_apply_once_and_repeat_harmlessly():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True


def test_env_var_turns_it_off():
    code = "from radixrt.model.cpu_malloc import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"RADIXRT_DISABLE_MALLOC_TUNING": "1", "PATH": ""},
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim is Linux-only")
def test_freed_memory_is_kept_until_released():
    code = """
import torch
from radixrt.model.cpu_malloc import keep_freed_memory, release_freed_memory
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20
assert keep_freed_memory()
base = rss_mib()
buffers = [torch.ones(1 << 20) for _ in range(200)]  # 800 MiB in 4 MiB buffers, under the mmap threshold
del buffers
held = rss_mib()
released = release_freed_memory()
print(base, held, rss_mib(), released)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, held, after, released = out.stdout.split()
    assert int(held) - int(base) > 600  # kept for the next forward
    assert int(after) - int(base) < 100 and released == "True"
