"""Attention over paged KV: torch reference ops (CPU path, test oracle) and Triton kernels.

This folder is the package ``radixrt.kernels``. With the repository root on ``sys.path`` (Python started in the
checkout) it is also found as the top-level package ``kernels``, the name of a PyPI package that transformers
imports. Imported under that name it hands the name over: it loads PyPI's ``kernels`` from the rest of
``sys.path`` in its own place (the import system returns what ``sys.modules`` holds once this file has run), or,
where that package is not installed, fails as a missing module would.
"""

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.realpath(_os.path.dirname(_os.path.dirname(__file__)))
    _rest = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
