"""radixrt: an SGLang-style LLM serving runtime.

`import radixrt` stays light: torch and the model code load only when the runtime is used
(`radixrt.Engine`), so a DSL client that talks to a server never imports them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# The frontend language (SGLang-compatible: programs run unchanged with `import radixrt as sgl`).
from radixrt.frontend.api import (  # noqa: E402
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    global_config,
    greedy_token_selection,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)

_LAZY = {
    "Engine": ("radixrt.engine", "Engine"),
    "ServerArgs": ("radixrt.server_args", "ServerArgs"),
    # DSL backends (their HTTP/OpenAI clients load on first use).
    "RuntimeEndpoint": ("radixrt.frontend.backend.runtime_endpoint", "RuntimeEndpoint"),
    "EngineBackend": ("radixrt.frontend.backend.engine", "EngineBackend"),
    "OpenAI": ("radixrt.frontend.backend.openai", "OpenAI"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
