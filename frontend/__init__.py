"""The radixrt frontend language: SGLang-compatible `@function` programs.

    import radixrt as sgl          # or: from radixrt import frontend as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

This package imports only the standard library (plus httpx / openai / tqdm when a backend or a
progress bar needs them); never torch or the runtime. See docs/frontend.md.
"""

from . import api
from .choices import ChoicesDecision, ChoicesSamplingMethod
from .fork_join import ProgramStateGroup
from .program import SglFunction
from .program_state import ProgramState

# the language's public names, listed once in api.__all__ (the backend classes load on first use)
globals().update({name: getattr(api, name) for name in api.__all__ if name not in api.LAZY})
__all__ = [*api.__all__, "ChoicesDecision", "ChoicesSamplingMethod", "ProgramState", "ProgramStateGroup",
           "SglFunction"]


def __getattr__(name: str):
    if name in api.LAZY:
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
