"""Tracing: run a program's Python with placeholder arguments and record its nodes, no model calls.

run_batch uses `extract_prefix_by_tracing` to find the text every program of the batch starts with
(constant strings and role markers up to the first argument, gen, select or fork) and prefills it
once before fanning out.
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Any, Dict, List, Optional

from .fork_join import ProgramStateGroup
from .ir import (
    SglArgument,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglFork,
    SglGen,
    SglGetForkItem,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
)


class StopTracing(Exception):
    """Raised inside a traced program once the rest cannot be part of a constant prefix."""


class TracingScope:
    cur_scope: Optional["TracingScope"] = None

    def __init__(self, tracer_state: "TracerProgramState"):
        self.tracer_state = tracer_state
        self.last_scope = None

    def __enter__(self):
        self.last_scope = TracingScope.cur_scope
        TracingScope.cur_scope = self
        return self

    def __exit__(self, exc_type, exc, tb):
        TracingScope.cur_scope = self.last_scope
        return False

    @staticmethod
    def get_current_scope() -> Optional["TracingScope"]:
        return TracingScope.cur_scope


def _chat_template_of(backend):
    if backend is not None:
        return backend.get_chat_template()
    from .chat_template import get_chat_template

    return get_chat_template("default")


def extract_prefix_by_tracing(program, backend) -> str:
    """The constant text every run of `program` starts with ("" when there is none)."""
    arguments: Dict[str, Any] = {name: SglArgument(name) for name in program.arg_names}
    arguments.update(program.bind_arguments)
    tracer = TracerProgramState(backend, arguments, only_trace_prefix=True)
    try:
        with TracingScope(tracer):
            tracer.ret_value = program.func(tracer, **arguments)
    except Exception:
        # StopTracing, or anything a placeholder argument provokes (f-strings, str(), len()...):
        # the prefix is what was recorded before it.
        pass
    prefix = ""
    for node in tracer.flatten_nodes():
        if not isinstance(node, SglConstantText):
            break
        prefix += node.value
    return prefix


def trace_program(program, arguments: Dict[str, Any], backend=None) -> "TracerProgramState":
    """Record the whole program's nodes; arguments not given become placeholders."""
    args = {name: SglArgument(name) for name in program.arg_names if name not in arguments}
    args.update(arguments)
    args.update(program.bind_arguments)
    tracer = TracerProgramState(backend, args, only_trace_prefix=False)
    with TracingScope(tracer):
        tracer.ret_value = program.func(tracer, **args)
    return tracer


class TracerProgramState:
    """Stands in for the program state `s` while tracing."""

    def __init__(self, backend, arguments: Dict[str, Any], only_trace_prefix: bool):
        self.pid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.only_trace_prefix = only_trace_prefix
        self.nodes: List[SglExpr] = []
        self.last_node: Optional[SglExpr] = None
        self.variables: Dict[str, SglVariable] = {}
        self.messages_: List[Dict[str, Any]] = []
        self.cur_role: Optional[str] = None
        self.chat_template = _chat_template_of(backend)
        self.child_states: List["TracerProgramState"] = []
        self.ret_value = None

    # Public API of a program state --------------------------------------------------------
    def __iadd__(self, other):
        self._execute(other)
        return self

    def _role_common(self, name: str, expr=None):
        if expr is not None:
            self._execute(SglExprList([SglRoleBegin(name), expr, SglRoleEnd(name)]))
            return None

        @contextmanager
        def role_scope():
            self._execute(SglRoleBegin(name))
            yield
            self._execute(SglRoleEnd(name))

        return role_scope()

    def system(self, expr=None):
        return self._role_common("system", expr)

    def user(self, expr=None):
        return self._role_common("user", expr)

    def assistant(self, expr=None):
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        self._execute(SglVarScopeBegin(name))
        yield
        self._execute(SglVarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset=None):
        if self.only_trace_prefix:
            raise StopTracing()
        fork_node = SglFork(size)
        fork_node.prev_node = self.last_node
        states = []
        for i in range(size):
            child = TracerProgramState(self.backend, self.arguments, self.only_trace_prefix)
            item = SglGetForkItem(i)
            item.prev_node = fork_node
            child.last_node = item
            child.variables = dict(self.variables)
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            states.append(child)
        self.child_states.extend(states)
        return ProgramStateGroup(states, self)

    def get_var(self, name: str):
        if self.only_trace_prefix:
            raise StopTracing()
        value = self.arguments.get(name)
        if value is not None:
            return value
        var = self.variables[name]
        return SglVariable(var.name, var.source)

    def __getitem__(self, name: str):
        return self.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = SglVariable(name, None)

    __setitem__ = set_var

    def text(self):
        raise StopTracing()

    def messages(self):
        raise StopTracing()

    def sync(self) -> None:
        pass

    def error(self):
        return None

    def get_meta_info(self, name: str):
        raise StopTracing()

    @property
    def stream_executor(self):  # join(): children need no syncing while tracing
        return _NullExecutor(self)

    # Recording ----------------------------------------------------------------------------
    def _append(self, node: SglExpr) -> None:
        node.pid = self.pid
        node.prev_node = self.last_node
        self.last_node = node
        self.nodes.append(node)
        if self.only_trace_prefix and not isinstance(node, SglConstantText):
            raise StopTracing()

    def _execute(self, other) -> None:
        if isinstance(other, str):
            other = SglConstantText(other)
        if other is None:
            raise ValueError("cannot append None to a program state")
        if isinstance(other, SglExprList):
            for x in other.expr_list:
                self._execute(x)
        elif isinstance(other, SglRoleBegin):
            self._role_begin(other.role)
        elif isinstance(other, SglRoleEnd):
            self._role_end(other.role)
        elif isinstance(other, (SglGen, SglSelect)):
            prefix = "gen_" if isinstance(other, SglGen) else "select_"
            name = other.name if other.name is not None else f"{prefix}{len(self.variables)}"
            self.variables[name] = SglVariable(name, other)
            self._append(other)
        elif isinstance(other, SglVarScopeEnd):
            self.variables[other.name] = SglVariable(other.name, self.last_node)
            self._append(other)
        elif isinstance(other, SglExpr):
            self._append(other)
        else:
            raise TypeError(f"cannot append {type(other).__name__} to a program state")

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError("nested roles are not allowed")
        if not self.messages_ and role != "system":
            default_system = self.chat_template.default_system_prompt
            if default_system:
                self._role_begin("system")
                self._append(SglConstantText(default_system))
                self._role_end("system")
        self.cur_role = role
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._append(SglConstantText(prefix))

    def _role_end(self, role: str) -> None:
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._append(SglConstantText(suffix))
        self.messages_.append({"role": role, "content": ""})
        self.cur_role = None

    def flatten_nodes(self) -> List[SglExpr]:
        out: List[SglExpr] = []

        def walk(node):
            if isinstance(node, SglExprList):
                for child in node.expr_list:
                    walk(child)
            else:
                out.append(node)

        for node in self.nodes:
            walk(node)
        return out

    def __repr__(self) -> str:
        return f"TracerProgramState({len(self.nodes)} nodes)"


class _NullExecutor:
    def __init__(self, state: TracerProgramState):
        self.variables = state.variables
        self.text_ = ""
        self.fork_start_text_pos = 0

    def sync(self) -> None:
        pass

    def end(self) -> None:
        pass
