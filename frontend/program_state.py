"""The program state `s`: what a program appends to and reads from, and what run() returns.

A ProgramState is a thin handle on its StreamExecutor (executor.py): `s += expr` submits,
`s["x"]`, `s.text()` and friends wait for the nodes before them, `s.fork(n)` gives a
ProgramStateGroup (fork_join.py). With run(stream=True), `text_iter` yields the text (or one
variable) as the worker produces it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

from .executor import StreamExecutor
from .fork_join import ProgramStateGroup
from .ir import (
    SglConstantText,
    SglExpr,
    SglExprList,
    SglRoleBegin,
    SglRoleEnd,
    SglVarScopeBegin,
    SglVarScopeEnd,
)


class ProgramState:
    """The `s` of a program and the result of run(): s += expr, s["var"], s.text(), ..."""

    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value = None

    # Roles ----------------------------------------------------------------------------------
    def _role_common(self, name: str, expr=None):
        if expr is not None:
            role_expr = SglExprList([SglRoleBegin(name), _as_expr(expr), SglRoleEnd(name)])
            self.stream_executor.submit(role_expr)
            return role_expr

        @contextmanager
        def role_scope():
            self.stream_executor.submit(SglRoleBegin(name))
            yield
            self.stream_executor.submit(SglRoleEnd(name))

        return role_scope()

    def system(self, expr=None):
        return self._role_common("system", expr)

    def user(self, expr=None):
        return self._role_common("user", expr)

    def assistant(self, expr=None):
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    # Fork -----------------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset=None) -> ProgramStateGroup:
        executors = self.stream_executor.fork(size, position_ids_offset)
        return ProgramStateGroup([ProgramState(x) for x in executors], self)

    @contextmanager
    def copy(self, position_ids_offset=None):
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # Reads ----------------------------------------------------------------------------------
    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> List[Dict[str, Any]]:
        return self.stream_executor.messages()

    def sync(self) -> None:
        return self.stream_executor.sync()

    def error(self) -> Optional[BaseException]:
        return self.stream_executor.error()

    def get_var(self, name: str):
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        return self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str):
        return self.stream_executor.get_meta_info(name)

    def text_iter(self, var_name: Optional[str] = None, return_meta_data: bool = False):
        """Yield the text as it is produced (run(stream=True)); without streaming, yield the
        final text (or variable) once."""
        exe = self.stream_executor
        if not exe.stream:
            value = self.text() if var_name is None else self.get_var(var_name)
            yield (value, exe.meta_info.get(var_name)) if return_meta_data else value
            return
        if var_name is None:
            yield from _stream_text(exe)
            return
        for out in _stream_variable(exe, var_name):
            yield (out, exe.meta_info.get(var_name)) if return_meta_data else out

    async def text_async_iter(self, var_name: Optional[str] = None, return_meta_data: bool = False):
        """`async for` over text_iter: the blocking waits run in the loop's default executor."""
        import asyncio

        loop = asyncio.get_running_loop()
        it = self.text_iter(var_name, return_meta_data)
        end = object()
        while True:
            item = await loop.run_in_executor(None, next, it, end)
            if item is end:
                return
            yield item

    # Appending ------------------------------------------------------------------------------
    def __iadd__(self, other):
        if other is None:
            raise ValueError("cannot append None to a program state")
        self.stream_executor.submit(_as_expr(other))
        return self

    def __getitem__(self, name: str):
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def __del__(self):
        try:
            self.stream_executor.end()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


def _as_expr(value) -> SglExpr:
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    raise TypeError(f"a program state takes str or sgl expressions, not {type(value).__name__}")


def _stream_text(exe: StreamExecutor) -> Iterator[str]:
    """The state's new text, chunk by chunk, until the worker finishes."""
    cv = exe.stream_cv
    prev = 0
    while True:
        with cv:
            cv.wait_for(lambda: len(exe.text_) > prev or exe.is_finished)
            finished = exe.is_finished
            out = exe.text_[prev:]
        prev += len(out)
        if out:
            yield out
        if finished:
            return


def _stream_variable(exe: StreamExecutor, var_name: str) -> Iterator[str]:
    """Variable `var_name`'s new text, chunk by chunk, until it is set or the worker finishes."""
    cv = exe.stream_cv
    prev = 0

    def var_state():
        value = exe.variables.get(var_name)
        event = exe.variable_event.get(var_name)
        done = exe.is_finished or (event is not None and event.is_set())
        return value, done

    while True:
        with cv:
            cv.wait_for(
                lambda: exe.is_finished
                or (var_name in exe.variables and (len(str(exe.variables[var_name])) > prev or var_state()[1]))
            )
            value, done = var_state()
        out = "" if value is None else str(value)[prev:]
        prev += len(out)
        if out:
            yield out
        if done:
            return
