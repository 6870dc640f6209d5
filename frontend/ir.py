"""The expression nodes a program appends to its state, and the `@function` wrapper.

A program is plain Python: `s += "text"` and `s += gen("x")` hand nodes of this module to the
state's executor (interpreter.py), which runs them in order on a backend. The same nodes are
recorded by the tracer (tracer.py) to find a program's constant prefix.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

# Regular expressions used by the typed generators (gen_int, gen(dtype=...)); same strings as SGLang.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

# Fields that a gen() may override on top of the run()'s defaults.
OVERRIDABLE_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "n",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "dtype",
    "regex",
    "json_schema",
)


@dataclasses.dataclass
class SglSamplingParams:
    """Sampling parameters of one generation call. On a gen() node the unset fields are None and
    the run()'s defaults fill them in (see StreamExecutor._resolve_sampling_params)."""

    max_new_tokens: Optional[int] = 128
    min_new_tokens: Optional[int] = 0
    n: Optional[int] = 1
    stop: Union[str, Sequence[str], None] = ()
    stop_token_ids: Optional[Sequence[int]] = ()
    stop_regex: Union[str, Sequence[str], None] = None
    temperature: Optional[float] = 1.0
    top_p: Optional[float] = 1.0
    top_k: Optional[int] = -1  # -1 disables top-k
    min_p: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    ignore_eos: Optional[bool] = False
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    # Constrained decoding.
    dtype: Any = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None

    def clone(self) -> "SglSamplingParams":
        out = dataclasses.replace(self)
        if isinstance(out.stop, list):
            out.stop = list(out.stop)
        if isinstance(out.stop_token_ids, list):
            out.stop_token_ids = list(out.stop_token_ids)
        return out

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    def to_native_kwargs(self) -> Dict[str, Any]:
        """The `sampling_params` object of the native /generate API (SGLang's field names).
        Fields left at None are omitted, so the server's own defaults apply."""
        out: Dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids or ()),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
        }
        if self.min_new_tokens:
            out["min_new_tokens"] = self.min_new_tokens
        if self.n is not None and self.n != 1:
            out["n"] = self.n
        for key in ("stop_regex", "regex", "json_schema"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return {k: v for k, v in out.items() if v is not None}

    def to_openai_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for the `openai` client; fields the OpenAI API lacks go in
        `extra_body` only when they are set, so a plain OpenAI server never sees them."""
        out: Dict[str, Any] = {
            "max_tokens": self.max_new_tokens,
            "stop": self.stop_list() or None,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        extra: Dict[str, Any] = {}
        if self.top_k is not None and self.top_k > 0:
            extra["top_k"] = self.top_k
        if self.min_p:
            extra["min_p"] = self.min_p
        if self.min_new_tokens:
            extra["min_tokens"] = self.min_new_tokens
        if self.ignore_eos:
            extra["ignore_eos"] = True
        if self.stop_token_ids:
            extra["stop_token_ids"] = list(self.stop_token_ids)
        for key in ("regex", "json_schema"):
            value = getattr(self, key)
            if value is not None:
                extra[key] = value
        if extra:
            out["extra_body"] = extra
        return {k: v for k, v in out.items() if v is not None}


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
        from .interpreter import run_program

        defaults = SglSamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
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
        )
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
        from .interpreter import run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch() takes a list of argument dicts (or of argument tuples)")
        if len(batch_kwargs) == 0:
            return []
        if not isinstance(batch_kwargs[0], dict):
            n_required = len(self.arg_names) - len(self.arg_defaults)
            converted = []
            for values in batch_kwargs:
                if not isinstance(values, (list, tuple)) or not (
                    n_required <= len(values) <= len(self.arg_names)
                ):
                    raise TypeError(
                        f"run_batch(): arguments {values!r} do not match the signature of {self.__name__}"
                    )
                converted.append(dict(zip(self.arg_names, values)))
            batch_kwargs = converted
        defaults = SglSamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
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
        )
        return run_program_batch(
            self, backend, list(batch_kwargs), defaults, num_threads, progress_bar, generator_style
        )

    def trace(self, *, backend=None, **kwargs):
        """Record the program's expression graph with placeholder arguments (no model calls)."""
        from .tracer import trace_program

        return trace_program(self, kwargs, backend)

    def cache(self, backend=None):
        """Prefill the program's constant prefix on the backend (what run_batch does first)."""
        from .interpreter import cache_program

        return cache_program(self, backend)

    def __call__(self, *args, **kwargs):
        from .tracer import StopTracing, TracingScope

        if TracingScope.get_current_scope() is not None:
            # A program called while another is being traced: its text is not a constant prefix.
            raise StopTracing()
        return self.run(*args, **kwargs)


class SglExpr:
    """Base of every node. `a + b` between nodes (or a node and a str) builds an SglExprList."""

    node_ct = 0

    def __init__(self):
        self.node_id = SglExpr.node_ct
        SglExpr.node_ct += 1
        self.prev_node: Optional[SglExpr] = None
        self.pid: Optional[str] = None

    def __add__(self, other):
        if isinstance(other, str):
            other = SglConstantText(other)
        if not isinstance(other, SglExpr):
            return NotImplemented
        return _concat(self, other)

    def __radd__(self, other):
        if isinstance(other, str):
            other = SglConstantText(other)
        if not isinstance(other, SglExpr):
            return NotImplemented
        return _concat(other, self)


def _concat(a: SglExpr, b: SglExpr) -> "SglExprList":
    left = a.expr_list if isinstance(a, SglExprList) else [a]
    right = b.expr_list if isinstance(b, SglExprList) else [b]
    return SglExprList(left + right)


class SglExprList(SglExpr):
    def __init__(self, expr_list: List[SglExpr]):
        super().__init__()
        self.expr_list = list(expr_list)

    def __repr__(self):
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str):
        super().__init__()
        self.value = value

    def __repr__(self):
        return f"Constant({self.value!r})"


class SglArgument(SglExpr):
    """A placeholder for a program argument while tracing."""

    def __init__(self, name: str, value: Any = None):
        super().__init__()
        self.name = name
        self.value = value

    def __repr__(self):
        return f"Argument({self.name})"

    def __format__(self, spec):
        raise TypeError("a traced argument cannot be formatted into an f-string")

    def __str__(self):
        raise TypeError("a traced argument has no string value")

    def __len__(self):
        raise TypeError("a traced argument has no length")

    def __getitem__(self, i):
        raise TypeError("a traced argument cannot be indexed")

    def __iter__(self):
        raise TypeError("a traced argument cannot be iterated")

    def __bool__(self):
        raise TypeError("a traced argument has no truth value")

    def __int__(self):
        raise TypeError("a traced argument has no integer value")


class SglGen(SglExpr):
    def __init__(self, name: Optional[str] = None, sampling_params: Optional[SglSamplingParams] = None):
        super().__init__()
        self.name = name
        self.sampling_params = sampling_params or SglSamplingParams(
            **{f.name: None for f in dataclasses.fields(SglSamplingParams)}
        )

    def __repr__(self):
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    def __init__(self, name: Optional[str], choices: List[str], temperature: float, choices_method):
        super().__init__()
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self):
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def __repr__(self):
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def __repr__(self):
        return f"RoleEnd({self.role})"


class SglImage(SglExpr):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def __repr__(self):
        return f"Image({self.path!r})"


class SglVideo(SglExpr):
    def __init__(self, path: str, num_frames: int):
        super().__init__()
        self.path = path
        self.num_frames = num_frames

    def __repr__(self):
        return f"Video({self.path!r}, {self.num_frames})"


class SglVariable(SglExpr):
    """A reference to another node's output (tracing only; at run time s["x"] is a str)."""

    def __init__(self, name: str, source: Optional[SglExpr]):
        super().__init__()
        self.name = name
        self.source = source

    def __repr__(self):
        return f"Variable({self.name!r})"


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __repr__(self):
        return f"VarScopeBegin({self.name!r})"


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __repr__(self):
        return f"VarScopeEnd({self.name!r})"


class SglFork(SglExpr):
    def __init__(self, number: int):
        super().__init__()
        self.number = number

    def __repr__(self):
        return f"Fork({self.number})"


class SglGetForkItem(SglExpr):
    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def __repr__(self):
        return f"GetForkItem({self.index})"


class SglConcateAndAppend(SglExpr):
    """join(mode="concate_and_append"): append the branches' new text to the parent."""

    def __init__(self, states):
        super().__init__()
        self.states = states

    def __repr__(self):
        return f"ConcatenateAndAppend({len(self.states)} states)"


class SglCommitLazy(SglExpr):
    """Send the text so far to the backend so its prefix is cached (used before a fork)."""

    def __repr__(self):
        return "CommitLazy()"
