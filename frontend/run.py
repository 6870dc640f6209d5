"""Running programs: the backend a program runs on, run(), run_batch() and prefix caching.

`run_program` builds a program state on a fresh executor and calls the program's function with
it; with stream=True the function runs on its own thread and run() returns at once.
`run_program_batch` runs one program per argument dict on a thread pool, after prefilling the
batch's constant prefix (found by tracing, see tracer.py) once. An exception raised by a
non-streamed program's own code propagates to the caller; a streamed one is reported by
`s.error()`.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Sequence, Tuple, Union

from .executor import StreamExecutor
from .global_config import global_config
from .program_state import ProgramState
from .sampling_params import SglSamplingParams

if TYPE_CHECKING:
    from .backend.base_backend import BaseBackend
    from .program import SglFunction

logger = logging.getLogger(__name__)

_ENGINE_BACKENDS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def resolve_backend(backend: Any = None) -> BaseBackend:
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


def _call_program(
    state: ProgramState,
    program: SglFunction,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    sync: bool,
    stream: bool,
) -> None:
    exe = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except Exception as e:
        if not stream:
            raise
        logger.warning("streamed program raised %r", e)
        exe.record_error(e)
    finally:
        exe.end()
    if sync:
        exe.sync()
    if global_config.verbosity >= 2:
        print(state.text())


def run_program(
    program: SglFunction,
    backend: Any,
    func_args: Sequence[Any],
    func_kwargs: Dict[str, Any],
    default_sampling_para: SglSamplingParams,
    stream: bool,
    sync: bool = False,
) -> ProgramState:
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
            args=(_call_program, state, program, tuple(func_args), kwargs, sync, True),
            daemon=True,
        )
        t.start()
    else:
        _call_program(state, program, tuple(func_args), kwargs, sync, False)
    return state


def cache_program(program: SglFunction, backend: Any = None) -> str:
    """Trace the program with placeholder arguments and prefill its constant prefix (when it is
    at least global_config.precache_min_chars long). Returns the prefix found."""
    from .tracer import extract_prefix_by_tracing

    backend = resolve_backend(backend)
    prefix = extract_prefix_by_tracing(program, backend)
    if prefix and len(prefix) >= global_config.precache_min_chars:
        backend.cache_prefix(prefix)
    return prefix


def run_program_batch(
    program: SglFunction,
    backend: Any,
    batch_arguments: List[Dict[str, Any]],
    default_sampling_para: SglSamplingParams,
    num_threads: Union[str, int],
    progress_bar: bool,
    generator_style: bool = False,
):
    """The states of one run per argument dict, in order: a list, or a generator of them when
    `generator_style` (submitted a chunk at a time)."""
    backend = resolve_backend(backend)
    if global_config.enable_precache_with_tracing and len(batch_arguments) > 1:
        cache_program(program, backend)
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    num_threads = max(1, min(int(num_threads), len(batch_arguments)))

    def one(arguments: Dict[str, Any]) -> ProgramState:
        return run_program(program, backend, (), arguments, default_sampling_para, False, True)

    if generator_style:
        return _run_batch_generator(one, batch_arguments, num_threads, progress_bar)
    return _run_batch_list(one, batch_arguments, num_threads, progress_bar)


def _run_batch_list(
    one: Callable[[Dict[str, Any]], ProgramState],
    batch_arguments: List[Dict[str, Any]],
    num_threads: int,
    progress_bar: bool,
) -> List[ProgramState]:
    pbar = _progress_bar(progress_bar, len(batch_arguments))
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


def _run_batch_generator(
    one: Callable[[Dict[str, Any]], ProgramState],
    batch_arguments: List[Dict[str, Any]],
    num_threads: int,
    progress_bar: bool,
) -> Iterator[ProgramState]:
    pbar = _progress_bar(progress_bar, len(batch_arguments))
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


def _progress_bar(enabled: bool, total: int):
    """A tqdm bar when one is asked for (tqdm is imported only then), else None."""
    if not enabled:
        return None
    import tqdm

    return tqdm.tqdm(total=total)
