"""The expression nodes a program appends to its state.

A program is plain Python: `s += "text"` and `s += gen("x")` hand nodes of this module to the
state's executor (executor.py), which runs them in order on a backend. The same nodes are
recorded by the tracer (tracer.py) to find a program's constant prefix. Nodes hold data only.

The sampling parameters, the `@function` wrapper and the typed-generation patterns live in
sampling_params.py, program.py and dtype_regex.py; they stay importable from here, SGLang's place
for them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from .dtype_regex import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from .program import SglFunction
from .sampling_params import OVERRIDABLE_FIELDS, SglSamplingParams

__all__ = [
    "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "OVERRIDABLE_FIELDS", "SglSamplingParams",
    "SglFunction", "SglExpr", "SglExprList", "SglConstantText", "SglArgument", "SglGen", "SglSelect",
    "SglRoleBegin", "SglRoleEnd", "SglImage", "SglVideo", "SglVariable", "SglVarScopeBegin",
    "SglVarScopeEnd", "SglFork", "SglGetForkItem", "SglConcateAndAppend", "SglCommitLazy",
]


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


class SglSeparateReasoning(SglExpr):
    """separate_reasoning(gen(...), model_type=...): once the generation is done, its variable keeps the answer
    and ``<name>_reasoning_content`` gets the reasoning block (SGLang's names)."""

    def __init__(self, model_type: str, expr: Optional[SglExpr]):
        super().__init__()
        self.model_type = model_type
        self.expr = expr
        self.target: Optional[str] = None  # the variable whose text is split
        self.name: Optional[str] = None  # the variable that gets the reasoning
        self._process_expr(expr)

    @staticmethod
    def process_name_for_reasoning(name: Optional[str]) -> str:
        if not name:
            raise ValueError("separate_reasoning() needs a named gen() or select()")
        return f"{name}_reasoning_content"

    def _process_expr(self, expr: Optional[SglExpr]) -> None:
        if isinstance(expr, (SglGen, SglSelect)):
            self.target = expr.name
            self.name = self.process_name_for_reasoning(expr.name)
        elif isinstance(expr, SglExprList):
            for x in expr.expr_list:
                self._process_expr(x)

    def __repr__(self):
        return f"SeparateReasoning({self.model_type!r}, {self.target!r})"
