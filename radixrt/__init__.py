"""radixrt: an SGLang-style LLM serving runtime.

`import radixrt` stays light: torch and the model code load only when the runtime is used
(`radixrt.Engine`), so a DSL client that talks to a server never imports them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("radixrt.engine", "Engine"),
    "ServerArgs": ("radixrt.server_args", "ServerArgs"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
