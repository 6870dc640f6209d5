"""radixrt: an SGLang-style LLM serving runtime.

`import radixrt` stays light: torch and the model code load only when the runtime is used
(`radixrt.Engine`), so a DSL client that talks to a server never imports them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# The frontend language (SGLang-compatible: programs run unchanged with `import radixrt as sgl`): its public
# names are listed once, in radixrt.frontend.api.__all__.
from radixrt.frontend import api as _api  # noqa: E402

globals().update({name: getattr(_api, name) for name in _api.__all__ if name not in _api.LAZY})

_LAZY = {
    "Engine": ("radixrt.engine", "Engine"),
    "ServerArgs": ("radixrt.server_args", "ServerArgs"),
}
__all__ = [*_api.__all__, *_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _api.LAZY:  # DSL backends: their HTTP/OpenAI clients load on first use
        return getattr(_api, name)
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
