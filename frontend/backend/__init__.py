"""Backends: where a program's generate/select calls go."""

from .base_backend import BaseBackend
from .engine import EngineBackend
from .native import NativeBackend
from .runtime_endpoint import RuntimeEndpoint

__all__ = ["BaseBackend", "EngineBackend", "NativeBackend", "RuntimeEndpoint", "OpenAI"]


def __getattr__(name):
    if name == "OpenAI":  # imports the `openai` package only when asked for
        from .openai import OpenAI

        return OpenAI
    raise AttributeError(name)
