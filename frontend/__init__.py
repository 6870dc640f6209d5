"""The radixrt frontend language: SGLang-compatible `@function` programs.

    import radixrt as sgl          # or: from radixrt import frontend as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

This package imports only the standard library (plus httpx / openai / tqdm when a backend or a
progress bar needs them); never torch or the runtime. See docs/frontend.md.
"""

from .api import (
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
from .choices import ChoicesDecision, ChoicesSamplingMethod
from .fork_join import ProgramStateGroup
from .program import SglFunction
from .program_state import ProgramState

__all__ = [
    "Runtime", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen",
    "gen_int", "gen_string", "get_default_backend", "get_server_info", "global_config",
    "greedy_token_selection", "image", "select", "set_default_backend", "system", "system_begin",
    "system_end", "token_length_normalized", "unconditional_likelihood_normalized", "user",
    "user_begin", "user_end", "video", "ChoicesDecision", "ChoicesSamplingMethod", "ProgramState",
    "ProgramStateGroup", "SglFunction", "RuntimeEndpoint", "EngineBackend", "OpenAI",
]


def __getattr__(name: str):
    if name in ("RuntimeEndpoint", "EngineBackend", "OpenAI"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
