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
