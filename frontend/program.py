"""The `@function` program: SglFunction wraps a Python function whose first argument is the state `s`.

`run` and `run_batch` turn their keyword arguments into the default SglSamplingParams and hand the
program to run.py; `trace` and `cache` go to tracer.py. Calling a program while another is traced
stops that trace (its text is not a constant prefix).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .sampling_params import SglSamplingParams


_RUN_FIELDS = (
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs",
)


def _run_defaults(arguments: Dict[str, Any]) -> SglSamplingParams:
    """The sampling keywords of run() / run_batch() as the program's default SglSamplingParams."""
    return SglSamplingParams(**{name: arguments[name] for name in _RUN_FIELDS})


class SglFunction:
    """A program: a Python function whose first argument is the state `s`."""

    def __init__(
        self,
        func: Callable,
        num_api_spec_tokens: Optional[int] = None,
        bind_arguments: Optional[Dict[str, Any]] = None,
    ):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        spec = inspect.getfullargspec(func)
        if not spec.args or spec.args[0] != "s":
            raise TypeError(
                f"@function {getattr(func, '__name__', func)!r}: the first argument must be named 's'"
            )
        self.arg_names = spec.args[1:]
        self.arg_defaults = spec.defaults or ()
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = getattr(func, "__doc__", None)

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"

    def bind(self, **kwargs) -> "SglFunction":
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__}.bind(): unknown arguments {unknown}")
        return SglFunction(
            self.func,
            num_api_spec_tokens=self.num_api_spec_tokens,
            bind_arguments={**self.bind_arguments, **kwargs},
        )

    def run(
        self,
        *args,
        max_new_tokens: int = 128,
        min_new_tokens: int = 0,
        stop: Union[str, List[str]] = (),
        stop_token_ids: Optional[List[int]] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None,
        stream: bool = False,
        backend=None,
        **kwargs,
    ):
        from .run import run_program

        defaults = _run_defaults(locals())
        return run_program(self, backend, args, kwargs, defaults, stream)

    def run_batch(
        self,
        batch_kwargs,
        *,
        max_new_tokens: int = 128,
        min_new_tokens: int = 0,
        stop: Union[str, List[str]] = (),
        stop_token_ids: Optional[List[int]] = (),
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None,
        backend=None,
        num_threads: Union[str, int] = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
    ):
        from .run import run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch() takes a list of argument dicts (or of argument tuples)")
        if len(batch_kwargs) == 0:
            return []
        batch_kwargs = self._argument_dicts(batch_kwargs)
        defaults = _run_defaults(locals())
        return run_program_batch(
            self, backend, batch_kwargs, defaults, num_threads, progress_bar, generator_style
        )

    def _argument_dicts(self, batch: Sequence[Any]) -> List[Dict[str, Any]]:
        """run_batch()'s arguments as dicts; a batch of tuples is matched to the signature by position."""
        if isinstance(batch[0], dict):
            return list(batch)
        n_required = len(self.arg_names) - len(self.arg_defaults)
        converted = []
        for values in batch:
            fits = isinstance(values, (list, tuple)) and n_required <= len(values) <= len(self.arg_names)
            if not fits:
                raise TypeError(
                    f"run_batch(): arguments {values!r} do not match the signature of {self.__name__}"
                )
            converted.append(dict(zip(self.arg_names, values)))
        return converted

    def trace(self, *, backend=None, **kwargs):
        """Record the program's expression graph with placeholder arguments (no model calls)."""
        from .tracer import trace_program

        return trace_program(self, kwargs, backend)

    def cache(self, backend=None):
        """Prefill the program's constant prefix on the backend (what run_batch does first)."""
        from .run import cache_program

        return cache_program(self, backend)

    def __call__(self, *args, **kwargs):
        from .tracer import StopTracing, TracingScope

        if TracingScope.get_current_scope() is not None:
            # A program called while another is being traced: its text is not a constant prefix.
            raise StopTracing()
        return self.run(*args, **kwargs)
