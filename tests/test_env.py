"""The registry of environment variables (radixrt/env.py): every RADIXRT_* name the source reads is in it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from radixrt import env

ROOT = Path(__file__).resolve().parents[1]


def test_every_radixrt_variable_in_the_source_is_registered():
    used = set()
    for folder in ("radixrt", "kernels", "frontend"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents if ROOT in p.parents):
                continue
            used |= set(re.findall(r"\bRADIXRT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert used, "the scan found nothing"
    assert used <= set(env.VARIABLES), f"not registered in radixrt/env.py: {sorted(used - set(env.VARIABLES))}"


def test_get_reads_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv("RADIXRT_TRITON_AUTOTUNE", raising=False)
    assert env.get("RADIXRT_TRITON_AUTOTUNE") == "1"
    monkeypatch.setenv("RADIXRT_DISABLE_CPU_KERNELS", "1")
    assert env.flag("RADIXRT_DISABLE_CPU_KERNELS")
    with pytest.raises(KeyError):
        env.get("RADIXRT_NO_SUCH_VARIABLE")


def test_radixrt_env_prints_each_variable_and_hides_keys(monkeypatch):
    out = subprocess.run([sys.executable, "-m", "radixrt.cli", "env"], capture_output=True, text=True, timeout=60,
                         env={"RADIXRT_API_KEY": "secret-value", "PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1",
                              **{k: v for k, v in __import__("os").environ.items() if k == "PYTHONPATH"}})
    assert out.returncode == 0, out.stderr
    for name, var in env.VARIABLES.items():
        assert name in out.stdout and var.meaning in out.stdout
    assert "secret-value" not in out.stdout and "set to '***'" in out.stdout
