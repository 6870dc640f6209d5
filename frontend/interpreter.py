"""Runs programs: the program state `s`, its executor thread, fork/join, run and run_batch.

Each program state owns a StreamExecutor with one worker thread. `s += expr` queues the node and
returns at once; the worker executes nodes in order against the backend. Reading a variable
(`s["x"]`), `s.text()` and friends wait for the nodes before them. An exception inside the worker
stops the program's remaining nodes and is reported by `s.error()`; waiting reads are released.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import uuid
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional

from .global_config import global_config
from .ir import (
    OVERRIDABLE_FIELDS,
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
    SglVideo,
)

logger = logging.getLogger(__name__)

_ENGINE_BACKENDS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def resolve_backend(backend=None):
    """The backend a program runs on: `backend` or the default; an engine object (anything
    with `generate`/`get_model_info`, e.g. `radixrt.Engine()`) is wrapped in an EngineBackend;
    an SGLang-style `Runtime` (with `.endpoint`) gives its endpoint."""
    from .backend.base_backend import BaseBackend

    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise RuntimeError(
            "no backend: call set_default_backend(RuntimeEndpoint(url) | Engine() | OpenAI(...)) "
            "or pass backend= to run()"
        )
    if isinstance(backend, BaseBackend):
        return backend
    endpoint = getattr(backend, "endpoint", None)
    if isinstance(endpoint, BaseBackend):
        return endpoint
    if callable(getattr(backend, "generate", None)):
        from .backend.engine import EngineBackend

        try:
            wrapped = _ENGINE_BACKENDS.get(backend)
        except TypeError:
            return EngineBackend(backend)
        if wrapped is None:
            wrapped = EngineBackend(backend)
            try:
                _ENGINE_BACKENDS[backend] = wrapped
            except TypeError:
                pass
        return wrapped
    raise TypeError(f"not a backend: {backend!r}")


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
        # Streaming readers wait on this; the worker notifies it after every change.
        self._stream_cv = threading.Condition()

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
        with self._stream_cv:
            self.is_finished = True
            self._stream_cv.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cv:
            if self.error_ is None:
                self.error_ = error
            self._failed = True
            self._pending.clear()
            self._inflight = 0
            self._release_events()
            self._cv.notify_all()

    def _release_events(self) -> None:
        for event in self.variable_event.values():
            event.set()

    def _notify_stream(self) -> None:
        with self._stream_cv:
            self._stream_cv.notify_all()

    def _init_var_event(self, expr) -> None:
        if isinstance(expr, (SglGen, SglSelect, SglVarScopeBegin)):
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
    def fork(self, size: int = 1, position_ids_offset=None) -> "ProgramStateGroup":
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
        cv = exe._stream_cv
        prev = 0
        if var_name is None:
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
                yield (out, exe.meta_info.get(var_name)) if return_meta_data else out
            if done:
                return

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


class ProgramStateGroup:
    """What s.fork(n) returns: n independent states sharing the parent's text."""

    def __init__(self, states: List[ProgramState], src_state: Optional[ProgramState] = None):
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable first set in the branches becomes, in the parent, the
        list of the branches' values. concate_and_append: the branches' new text is appended to
        the parent, in order."""
        if mode == "gather_variable":
            src_vars = self.src_state.stream_executor.variables
            existing = set(src_vars)
            for child in self.states:
                child.stream_executor.sync()
                for k, v in child.stream_executor.variables.items():
                    if k in existing:
                        continue
                    src_vars.setdefault(k, []).append(v)
        elif mode == "concate_and_append":
            self.src_state += SglConcateAndAppend(self.states)
            self.src_state.stream_executor.sync()
        else:
            raise ValueError(f"unknown join mode {mode!r} (gather_variable, concate_and_append)")
        for s in self.states:
            s.stream_executor.end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value) -> None:
        if self.states[i] is not value:
            raise ValueError("forks[i] += ... must append to the same fork")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other):
        if callable(other) and not isinstance(other, SglExpr):
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (SglExpr, str)):
            for s in self.states:
                s += other
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError("forks += list: one item per fork")
            for s, x in zip(self.states, other):
                s += x
        else:
            raise TypeError(f"cannot append {type(other).__name__} to forks")
        return self


# Running programs -----------------------------------------------------------------------------
def _run_internal(state: ProgramState, program, args, kwargs, sync: bool, stream: bool) -> None:
    exe = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except Exception as e:
        if not stream:
            raise
        logger.warning("streamed program raised %r", e)
        with exe._cv:
            if exe.error_ is None:
                exe.error_ = e
    finally:
        exe.end()
    if sync:
        exe.sync()
    if global_config.verbosity >= 2:
        print(state.text())


def run_program(program, backend, func_args, func_kwargs, default_sampling_para, stream, sync=False):
    backend = resolve_backend(backend)
    kwargs = dict(func_kwargs)
    kwargs.update(program.bind_arguments)
    exe = StreamExecutor(
        backend,
        kwargs,
        default_sampling_para,
        chat_template=None,
        stream=stream,
        num_api_spec_tokens=program.num_api_spec_tokens,
    )
    state = ProgramState(exe)
    if stream:
        ctx = contextvars.copy_context()
        t = threading.Thread(
            target=ctx.run,
            args=(_run_internal, state, program, tuple(func_args), kwargs, sync, True),
            daemon=True,
        )
        t.start()
    else:
        _run_internal(state, program, tuple(func_args), kwargs, sync, False)
    return state


def cache_program(program, backend=None) -> str:
    """Trace the program with placeholder arguments and prefill its constant prefix (when it is
    at least global_config.precache_min_chars long). Returns the prefix found."""
    from .tracer import extract_prefix_by_tracing

    backend = resolve_backend(backend)
    prefix = extract_prefix_by_tracing(program, backend)
    if prefix and len(prefix) >= global_config.precache_min_chars:
        backend.cache_prefix(prefix)
    return prefix


def run_program_batch(
    program,
    backend,
    batch_arguments: List[Dict[str, Any]],
    default_sampling_para,
    num_threads,
    progress_bar: bool,
    generator_style: bool = False,
):
    backend = resolve_backend(backend)
    if global_config.enable_precache_with_tracing and len(batch_arguments) > 1:
        cache_program(program, backend)
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    num_threads = max(1, min(int(num_threads), len(batch_arguments)))

    def one(arguments):
        return run_program(program, backend, (), arguments, default_sampling_para, False, True)

    if generator_style:
        return _run_batch_generator(one, batch_arguments, num_threads, progress_bar)

    pbar = None
    if progress_bar:
        import tqdm

        pbar = tqdm.tqdm(total=len(batch_arguments))
    try:
        if num_threads == 1:
            rets = []
            for arguments in batch_arguments:
                rets.append(one(arguments))
                if pbar is not None:
                    pbar.update()
        else:
            with ThreadPoolExecutor(num_threads) as pool:
                futures = [pool.submit(one, a) for a in batch_arguments]
                if pbar is not None:
                    for f in futures:
                        f.add_done_callback(lambda _: pbar.update())
                rets = [f.result() for f in futures]
    finally:
        if pbar is not None:
            pbar.close()
    return rets


def _run_batch_generator(one: Callable, batch_arguments, num_threads: int, progress_bar: bool):
    pbar = None
    if progress_bar:
        import tqdm

        pbar = tqdm.tqdm(total=len(batch_arguments))
    try:
        with ThreadPoolExecutor(num_threads) as pool:
            chunk = max(num_threads * 2, 64)
            for lo in range(0, len(batch_arguments), chunk):
                futures = [pool.submit(one, a) for a in batch_arguments[lo : lo + chunk]]
                for f in futures:
                    ret = f.result()
                    if pbar is not None:
                        pbar.update()
                    yield ret
    finally:
        if pbar is not None:
            pbar.close()
