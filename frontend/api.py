"""The public names of the language (what `import radixrt as sgl` gives, as `import sglang as sgl`).

``__all__`` is the one list of them: radixrt.frontend and radixrt export exactly these (the backend classes in
``LAZY`` load on first use), plus what each adds of its own.
"""

from __future__ import annotations

import re
from typing import Any, Callable, List, Optional, Union

from .choices import (
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from .global_config import global_config
from .ir import SglExpr, SglExprList, SglGen, SglRoleBegin, SglRoleEnd, SglSelect, SglSeparateReasoning
from .program import SglFunction
from .runtime import Runtime
from .sampling_params import SglSamplingParams

__all__ = [
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "image",
    "video",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    "separate_reasoning",
    "set_default_backend",
    "get_default_backend",
    "flush_cache",
    "get_server_info",
    "Runtime",
    "RuntimeEndpoint",
    "EngineBackend",
    "OpenAI",
    "global_config",
    "token_length_normalized",
    "greedy_token_selection",
    "unconditional_likelihood_normalized",
]


def function(func: Optional[Callable] = None, num_api_spec_tokens: Optional[int] = None):
    """`@function` or `@function(num_api_spec_tokens=...)`: make a program from a Python function
    whose first argument is the state `s`. (num_api_spec_tokens is accepted for compatibility;
    API speculative execution is not implemented.)"""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f):
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def set_default_backend(backend) -> None:
    """The backend programs run on by default: RuntimeEndpoint(url), OpenAI(...), an
    EngineBackend, a `Runtime` (its endpoint runs them), or an engine object itself (e.g.
    `radixrt.Engine()`, wrapped in an EngineBackend when a program runs). As in SGLang,
    `global_config.default_backend` is the object set (programs read `default_backend.endpoint`)."""
    from .run import resolve_backend

    if backend is not None:
        resolve_backend(backend)  # a TypeError now for what cannot run programs
    global_config.default_backend = backend


def get_default_backend():
    return global_config.default_backend


def flush_cache(backend=None):
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return False
    from .run import resolve_backend

    return resolve_backend(backend).flush_cache()


def get_server_info(backend=None):
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return None
    from .run import resolve_backend

    return resolve_backend(backend).get_server_info()


def _gen_params(**kwargs) -> SglSamplingParams:
    return SglSamplingParams(**kwargs)


def gen(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    min_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Optional[Union[str, List[str]]] = None,
    stop_token_ids: Optional[List[int]] = None,
    stop_regex: Optional[Union[str, List[str]]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
    dtype: Optional[Union[type, str]] = None,
    choices: Optional[List[str]] = None,
    choices_method: Optional[ChoicesSamplingMethod] = None,
    regex: Optional[str] = None,
    json_schema: Optional[Any] = None,
    max_new_tokens: Optional[int] = None,
    min_new_tokens: Optional[int] = None,
) -> SglExpr:
    """Generate text into variable `name`. Unset arguments take the run()'s values.
    `choices=[...]` makes it a select(); `regex`/`json_schema`/`dtype` constrain the output."""
    if choices:
        return SglSelect(
            name,
            choices,
            0.0 if temperature is None else temperature,
            token_length_normalized if choices_method is None else choices_method,
        )
    if max_tokens is not None and max_new_tokens is not None and max_tokens != max_new_tokens:
        raise ValueError("gen(): max_tokens and max_new_tokens disagree")
    if regex is not None:
        re.compile(regex)  # a bad pattern fails here, in the program, not on the server
    return SglGen(
        name,
        _gen_params(
            max_new_tokens=max_tokens if max_tokens is not None else max_new_tokens,
            min_new_tokens=min_tokens if min_tokens is not None else min_new_tokens,
            n=n,
            stop=stop,
            stop_token_ids=stop_token_ids,
            stop_regex=stop_regex,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            ignore_eos=ignore_eos,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            dtype=dtype,
            regex=regex,
            json_schema=json_schema,
        ),
    )


def _typed_gen(dtype, name, max_tokens, min_tokens, n, stop, stop_token_ids, stop_regex, temperature,
               top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
               logprob_start_len, top_logprobs_num, return_text_in_logprobs):
    return gen(
        name, max_tokens, min_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k,
        min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
        top_logprobs_num, return_text_in_logprobs, dtype=dtype,
    )


def gen_int(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Optional[Union[str, List[str]]] = None,
    stop_token_ids: Optional[List[int]] = None,
    stop_regex: Optional[Union[str, List[str]]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
    min_tokens: Optional[int] = None,
) -> SglExpr:
    """Generate an integer (as text): gen(dtype=int)."""
    return _typed_gen(int, name, max_tokens, min_tokens, n, stop, stop_token_ids, stop_regex, temperature,
                      top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
                      logprob_start_len, top_logprobs_num, return_text_in_logprobs)


def gen_string(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Optional[Union[str, List[str]]] = None,
    stop_token_ids: Optional[List[int]] = None,
    stop_regex: Optional[Union[str, List[str]]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
    min_tokens: Optional[int] = None,
) -> SglExpr:
    """Generate a double-quoted string: gen(dtype=str)."""
    return _typed_gen(str, name, max_tokens, min_tokens, n, stop, stop_token_ids, stop_regex, temperature,
                      top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob,
                      logprob_start_len, top_logprobs_num, return_text_in_logprobs)


def select(
    name: Optional[str] = None,
    choices: Optional[List[str]] = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> SglExpr:
    """Append the choice the model scores highest (by `choices_method`) and store it in `name`."""
    if not choices:
        raise ValueError("select() needs a non-empty list of choices")
    return SglSelect(name, choices, temperature, choices_method)


def image(expr) -> SglExpr:
    raise NotImplementedError("sgl.image(): radixrt serves text-only models; images are not supported")


def video(path: str, num_frames: int) -> SglExpr:
    raise NotImplementedError("sgl.video(): radixrt serves text-only models; videos are not supported")


def _role_common(name: str, expr=None) -> SglExprList:
    if expr is None:
        return SglExprList([SglRoleBegin(name), SglRoleEnd(name)])
    return SglExprList([SglRoleBegin(name), expr, SglRoleEnd(name)])


def system(expr=None) -> SglExprList:
    return _role_common("system", expr)


def user(expr=None) -> SglExprList:
    return _role_common("user", expr)


def assistant(expr=None) -> SglExprList:
    return _role_common("assistant", expr)


def system_begin() -> SglRoleBegin:
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    return SglRoleEnd("assistant")


LAZY = {
    # The backend classes import their HTTP/OpenAI clients only when first used.
    "RuntimeEndpoint": (".backend.runtime_endpoint", "RuntimeEndpoint"),
    "EngineBackend": (".backend.engine", "EngineBackend"),
    "OpenAI": (".backend.openai", "OpenAI"),
}


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        module, attr = LAZY[name]
        return getattr(importlib.import_module(module, __package__), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def separate_reasoning(expr: Optional[SglExpr] = None, model_type: Optional[str] = None) -> SglExpr:
    """Run ``expr`` (a named ``gen`` or ``select``), then split its text as ``--reasoning-parser model_type`` does
    (``deepseek-r1``, ``qwen3``, ``qwen3-thinking``): the variable keeps the answer, ``<name>_reasoning_content``
    gets the reasoning block (SGLang's DSL)."""
    from radixrt.reasoning import REASONING_FORMATS

    if model_type not in REASONING_FORMATS:
        raise ValueError(f"separate_reasoning(model_type=...) must be one of {', '.join(REASONING_FORMATS)}")
    return SglExprList([expr, SglSeparateReasoning(model_type, expr=expr)])
