"""The executor behind a program state: one worker thread that runs the state's nodes in order.

`s += expr` submits the node and returns at once; the worker executes nodes in submission order
against the backend, appending to the state's text, messages and variables. Reading a variable
waits for the node that sets it; `text()`, `messages()` and `error()` wait for every node before
them. An exception inside the worker stops the program's remaining nodes and is reported by
`error()`; waiting reads are released. `fork()` copies the executor's state into fresh executors
(after prefilling the shared text once). Backends read `text_`, `sid` and the chat template.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import uuid
from collections import deque
from typing import Any, Dict, List, Optional

from .ir import (
    SglCommitLazy,
    SglConcateAndAppend,
    SglSeparateReasoning,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
    SglVideo,
)
from .sampling_params import OVERRIDABLE_FIELDS, SglSamplingParams

logger = logging.getLogger(__name__)


class StreamExecutor:
    """Executes one program state's nodes in order on a worker thread."""

    def __init__(
        self,
        backend,
        arguments: Dict[str, Any],
        default_sampling_para: SglSamplingParams,
        chat_template=None,
        stream: bool = False,
        num_api_spec_tokens: Optional[int] = None,
    ):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens  # accepted; API speculation is not done

        self.variables: Dict[str, Any] = {}
        self.variable_event: Dict[str, threading.Event] = {}
        self.meta_info: Dict[str, Any] = {}
        self.is_finished = False
        self.error_: Optional[BaseException] = None

        self.text_ = ""
        self.messages_: List[Dict[str, Any]] = []
        self.chat_template = chat_template or backend.get_chat_template()
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos: Optional[int] = None
        self.fork_start_text_pos: Optional[int] = None
        self.images_: List[Any] = []
        self._scope_start: Dict[str, int] = {}

        # Work queue. `_inflight` counts submitted nodes not yet finished (sync waits for 0).
        self._cv = threading.Condition()
        self._pending: deque = deque()
        self._inflight = 0
        self._closed = False
        self._failed = False
        self._ended = False
        # Streaming readers (ProgramState.text_iter) wait on this; the worker notifies it after every change.
        self.stream_cv = threading.Condition()

        ctx = contextvars.copy_context()
        self.worker = threading.Thread(
            target=ctx.run, args=(self._worker,), name=f"radixrt-program-{self.sid[:8]}", daemon=True
        )
        self.worker.start()

    # Queue ----------------------------------------------------------------------------------
    def submit(self, expr: SglExpr) -> None:
        with self._cv:
            self._init_var_event(expr)
            if self._failed:
                self._release_events()
                return
            if self._closed:
                raise RuntimeError("this program state has ended (a fork appended to after join?)")
            self._pending.append(expr)
            self._inflight += 1
            self._cv.notify_all()

    def sync(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._inflight == 0)

    def end(self) -> None:
        with self._cv:
            if self._ended:
                return
            self._ended = True
            self._closed = True
            self._cv.notify_all()
        try:
            self.backend.end_program(self)
        except Exception:  # a hint only
            logger.debug("end_program failed", exc_info=True)

    def _worker(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    break
                expr = self._pending.popleft()
            try:
                self._execute(expr)
            except Exception as e:  # reported by state.error()
                logger.warning("program %s failed: %r", self.sid[:8], e, exc_info=True)
                self._fail(e)
                break
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
            self._notify_stream()
        with self.stream_cv:
            self.is_finished = True
            self.stream_cv.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cv:
            if self.error_ is None:
                self.error_ = error
            self._failed = True
            self._pending.clear()
            self._inflight = 0
            self._release_events()
            self._cv.notify_all()

    def record_error(self, error: BaseException) -> None:
        """Report an error raised outside the worker (by a streamed program's own code); the first wins."""
        with self._cv:
            if self.error_ is None:
                self.error_ = error

    def _release_events(self) -> None:
        for event in self.variable_event.values():
            event.set()

    def _notify_stream(self) -> None:
        with self.stream_cv:
            self.stream_cv.notify_all()

    def _init_var_event(self, expr) -> None:
        if isinstance(expr, (SglGen, SglSelect, SglVarScopeBegin, SglSeparateReasoning)):
            if expr.name is not None:
                self.variable_event[expr.name] = threading.Event()
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._init_var_event(e)

    # Reads ----------------------------------------------------------------------------------
    def get_var(self, name: str):
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise RuntimeError(
                f"variable {name!r} was not produced: the program failed with {self.error_!r}"
            ) from self.error_
        raise KeyError(name)

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def get_meta_info(self, name: str, timeout: Optional[float] = None):
        event = self.variable_event.get(name)
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"timed out waiting for {name!r}")
        return self.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> List[Dict[str, Any]]:
        self.sync()
        return self.messages_

    def error(self) -> Optional[BaseException]:
        self.sync()
        return self.error_

    # Fork -----------------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset=None) -> List["StreamExecutor"]:
        size = int(size)
        if size < 1:
            raise ValueError("fork() needs size >= 1")
        self.sync()
        if size > 1 and self.text_ and not self._failed:
            # Prefill the shared prefix once so every branch finds it in the prefix cache.
            self.submit(SglCommitLazy())
            self.sync()
        children = []
        for _ in range(size):
            child = StreamExecutor(
                self.backend, self.arguments, self.default_sampling_para, self.chat_template, self.stream
            )
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
            child.images_ = list(self.images_)
            children.append(child)
        return children

    # Execution ------------------------------------------------------------------------------
    def _execute(self, other) -> None:
        if isinstance(other, str):
            other = SglConstantText(other)
        if isinstance(other, SglConstantText):
            self._execute_fill(other.value)
        elif isinstance(other, SglExprList):
            for x in other.expr_list:
                self._execute(x)
        elif isinstance(other, SglGen):
            self._execute_gen(other)
        elif isinstance(other, SglSelect):
            self._execute_select(other)
        elif isinstance(other, SglRoleBegin):
            self._execute_role_begin(other)
        elif isinstance(other, SglRoleEnd):
            self._execute_role_end(other)
        elif isinstance(other, SglVarScopeBegin):
            self._scope_start[other.name] = len(self.text_)
        elif isinstance(other, SglVarScopeEnd):
            self._execute_var_scope_end(other)
        elif isinstance(other, SglVariable):
            self._execute_fill(self.get_var(other.name))
        elif isinstance(other, SglCommitLazy):
            self.backend.commit_lazy_operations(self)
        elif isinstance(other, SglConcateAndAppend):
            self._execute_concatenate_and_append(other)
        elif isinstance(other, SglSeparateReasoning):
            self._execute_separate_reasoning(other)
        elif isinstance(other, (SglImage, SglVideo)):
            raise NotImplementedError("images and videos are not supported: radixrt serves text-only models")
        else:
            raise TypeError(f"cannot append {type(other).__name__} to a program state")

    def _execute_fill(self, value) -> None:
        self.text_ += str(value)

    def _execute_gen(self, expr: SglGen) -> None:
        sp = self._resolve_sampling_params(expr.sampling_params)
        name = expr.name
        if not self.stream:
            comp, meta_info = self.backend.generate(self, sampling_params=sp)
            self.text_ += comp[0] if isinstance(comp, list) else comp
            if name is not None:
                self.variables[name] = comp
                self.meta_info[name] = meta_info
                self.variable_event[name].set()
            return
        if name is not None:
            self.variables[name] = ""
        self._notify_stream()
        for delta, meta_info in self.backend.generate_stream(self, sampling_params=sp):
            self.text_ += delta
            if name is not None:
                self.variables[name] += delta
                self.meta_info[name] = meta_info
            self._notify_stream()
        if name is not None:
            self.variable_event[name].set()

    def _execute_select(self, expr: SglSelect) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        if expr.name is not None:
            self.variables[expr.name] = decision.decision
            self.meta_info[expr.name] = decision.meta_info
            self.variable_event[expr.name].set()
        self.text_ += decision.decision

    def _execute_role_begin(self, expr: SglRoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"nested roles: {expr.role} begins inside {self.cur_role}")
        if not self.messages_ and expr.role != "system":
            default_system = self.chat_template.default_system_prompt
            if default_system:
                self._execute_role_begin(SglRoleBegin("system"))
                self._execute_fill(default_system)
                self._execute_role_end(SglRoleEnd("system"))
        self.cur_role = expr.role
        prefix, _ = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._execute_fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _execute_role_end(self, expr: SglRoleEnd) -> None:
        if self.cur_role is None:
            raise ValueError(f"{expr.role}_end() without {expr.role}_begin()")
        if self.cur_role != expr.role:
            raise ValueError(f"{expr.role}_end() inside a {self.cur_role} role")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._execute_fill(suffix)
        self.messages_.append({"role": expr.role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None

    def _execute_var_scope_end(self, expr: SglVarScopeEnd) -> None:
        if expr.name not in self._scope_start:
            raise ValueError(f"var_scope {expr.name!r} ended without beginning")
        self.variables[expr.name] = self.text_[self._scope_start.pop(expr.name):]
        self.variable_event[expr.name].set()

    def _execute_separate_reasoning(self, expr: SglSeparateReasoning) -> None:
        """Split the generated variable's text (final by now, streamed or not) into answer and reasoning; the
        state's text keeps the output whole."""
        from radixrt.reasoning import reasoning_format, split_reasoning

        if expr.target is None:
            return
        text = self.get_var(expr.target)
        fmt = reasoning_format(expr.model_type)
        prompt = self.text_[: len(self.text_) - len(text)] if self.text_.endswith(text) else ""
        reasoning, answer = split_reasoning(fmt, text, fmt.starts_in_reasoning(prompt[-64:]))
        self.variables[expr.target] = answer
        self.variables[expr.name] = reasoning or ""
        self.variable_event[expr.name].set()

    def _execute_concatenate_and_append(self, expr: SglConcateAndAppend) -> None:
        new_text = ""
        for state in expr.states:
            exe = state.stream_executor
            exe.sync()
            new_text += exe.text_[exe.fork_start_text_pos:]
        self._execute_fill(new_text)

    def _resolve_sampling_params(self, sampling_params: SglSamplingParams) -> SglSamplingParams:
        """The run()'s defaults, overridden by the gen()'s set fields; the chat template's stop
        strings are added to the stop list."""
        out = self.default_sampling_para.clone()
        for field in OVERRIDABLE_FIELDS:
            value = getattr(sampling_params, field, None)
            if value is not None:
                setattr(out, field, value)
        if self.chat_template.stop_str:
            out.stop = out.stop_list() + [x for x in self.chat_template.stop_str if x not in out.stop_list()]
        return out
