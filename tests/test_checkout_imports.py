"""Python started in the repository root (the root first on sys.path, no environment variables) imports radixrt
and loads a model: the checkout's `kernels/` folder, found there as the top-level package `kernels`, hands that
name to PyPI's `kernels` package, which transformers imports (or fails as a missing module where it is not
installed), instead of shadowing it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# no PYTHONPATH, no PYTHONSAFEPATH: `python -c` puts the working directory (the root) first on sys.path
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}


def _run(code: str, *flags: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, env=CLEAN_ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.model
def test_python_in_the_repository_root_loads_the_default_model(default_model_path):
    code = ("import sys, radixrt\n"
            "assert sys.path[0] in ('', '.') or sys.path[0] == __import__('os').getcwd(), sys.path[:2]\n"
            "from transformers import AutoModelForCausalLM  # imports `kernels`, PyPI's\n"
            "with radixrt.Engine(model_path='smollm2-135m', dtype='float32', kv_memory_gb=0.05, log_interval=0) as e:\n"
            "    out = e.generate('The capital of France is', {'max_new_tokens': 2, 'temperature': 0})\n"
            "print('generated', len(out['output_ids']))\n")
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "generated 2" in out.stdout


def test_the_name_kernels_is_pypi_s_package_or_missing():
    import importlib.util

    pypi = importlib.util.find_spec("kernels") is not None and "site-packages" in (
        importlib.util.find_spec("kernels").origin or "")
    out = _run("import kernels; print(kernels.__file__)")
    if pypi:
        assert out.returncode == 0, out.stderr[-2000:]
        assert "site-packages" in out.stdout and str(ROOT / "kernels") not in out.stdout
    # without site-packages (-S) only the checkout's folder carries the name: it is no PyPI package
    missing = _run("import sys; sys.path.insert(0, ''); import kernels", "-S")
    assert missing.returncode != 0 and "No module named 'kernels'" in missing.stderr


def test_the_checkout_s_kernels_are_still_radixrt_kernels():
    out = _run("import radixrt.kernels.torch_ref as t, kernels; print(t.__name__, kernels.__name__)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["radixrt.kernels.torch_ref", "kernels"]
