"""The in-process runtime, call-compatible with SGLang's offline Engine.

The scheduler runs in a background thread; calls from any number of threads (or coroutines) batch together.
Token ids become text on a second thread (``radixrt-detokenizer``), off the scheduler's, in the order the
scheduler emitted them.
A request the runtime cannot serve raises ``ValueError`` before it is queued; a request that failed inside the
runtime (its batch's forward failed) raises ``RuntimeError`` while the engine keeps serving. Only a model that
can no longer run stops the scheduler thread: then every call raises ``EngineDead`` at once, with the cause.
Under tensor parallelism (``tp_size > 1``) this process is rank 0 and spawns the other ranks; a rank that
dies stops the scheduler thread the same way (``EngineDead``, the cause a ``RankFailure``), and ``shutdown``
stops the follower processes. Engines still running when the interpreter exits are shut down first (as
SGLang's Engine does), so a script that never calls ``shutdown()`` ends cleanly.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import queue
import threading
import uuid
import weakref
from typing import Any, AsyncIterator, Iterator

from radixrt.detokenize import Detokenizer
from radixrt.messages import AbortReq, BatchTokenOut, StrDelta
from radixrt.response import ResponseBuilder
from radixrt.requests import Prepared, expand, prepare
from radixrt.server_args import ServerArgs
from radixrt.step_profiler import StepProfiler

logger = logging.getLogger("radixrt.engine")

_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
POLL_SECONDS = 0.5  # how often a waiting caller checks that the scheduler thread is still alive


class EngineDead(RuntimeError):
    """The scheduler thread has stopped (the model cannot run, or the engine was shut down)."""


def raise_for_finish(builder: ResponseBuilder) -> None:
    """A request that ended in error: ValueError for a request the runtime refused, RuntimeError for a failure
    inside the runtime. A client's own abort is not an error."""
    reason = builder.finish_reason
    if reason is None or not reason.is_error:
        return
    if reason.is_server_error:
        raise RuntimeError(reason.message)
    raise ValueError(reason.message)


class _Waiter:
    """Where one request's deltas go: a thread-safe queue, or an asyncio queue on the caller's loop."""

    def __init__(self, builder: ResponseBuilder, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.builder = builder
        self.loop = loop
        self.queue: queue.Queue | asyncio.Queue = asyncio.Queue() if loop else queue.Queue()

    def put(self, item: Any) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        else:
            self.queue.put(item)


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        from radixrt.loaded_model import LoadedModel
        from radixrt.scheduler.scheduler import Scheduler

        self.args = ServerArgs.from_kwargs(**kwargs)
        self.loaded = LoadedModel.load(self.args)
        self.model_path = self.loaded.model_path
        self.tokenizer = self.loaded.tokenizer
        self.runner = self.loaded.runner
        self.eos_ids = self.loaded.eos_ids
        self.grammars = self.loaded.grammars
        self.chat_template = self.loaded.chat_template
        try:
            self.scheduler = Scheduler(self.args, self.runner, self.tokenizer, self.eos_ids, self._on_tokens,
                                       self.grammars)
        except BaseException:
            self.loaded.close()
            raise
        self.detokenizer = Detokenizer(self.tokenizer)
        self._outputs: queue.SimpleQueue[BatchTokenOut | None] = queue.SimpleQueue()
        self._detokenizer_thread = threading.Thread(target=self._detokenize_loop, name="radixrt-detokenizer",
                                                    daemon=True)
        self._detokenizer_thread.start()
        self._profiler = StepProfiler()
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._counter = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="radixrt-scheduler", daemon=True)
        self._thread.start()
        _LIVE_ENGINES.add(self)

    # ----- the scheduler thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self.loaded.check_ranks()
                if not self.scheduler.step():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
            self.loaded.close()  # here: the follower ranks take their stop in step order
        except BaseException as exc:  # the model cannot run any more: fail every caller instead of hanging them
            logger.exception("the scheduler thread died")
            self._error = exc
            self._fail_waiters(exc)
            self.scheduler.fail_control_calls(exc)
            if self.loaded.world is not None:
                self.loaded.world.abort()

    def _fail_waiters(self, exc: BaseException) -> None:
        with self._lock:
            waiters = list(self._waiters.values())
            self._waiters.clear()
        for waiter in waiters:
            waiter.put(exc)

    def _on_tokens(self, batch: BatchTokenOut) -> None:
        """The scheduler's sink (its thread): hand the batch to the detokenizer thread."""
        self._outputs.put(batch)

    def _detokenize_loop(self) -> None:
        while (batch := self._outputs.get()) is not None:
            try:
                self._deliver(batch)
            except Exception:  # a bug here must not strand the callers of every later batch
                logger.exception("delivering a batch of outputs failed")

    def _deliver(self, batch: BatchTokenOut) -> None:
        for out in self.detokenizer.process(batch).outputs:
            reason = out.delta.finish_reason
            with self._lock:
                waiter = self._waiters.get(out.rid)
                if waiter is not None and reason is not None:
                    del self._waiters[out.rid]
            if waiter is not None:
                waiter.put(out)
            if reason is not None and reason.is_server_error:
                self.scheduler.submit(AbortReq(rid=out.rid))  # failed after the scheduler: free its pages too

    # ----- requests -----------------------------------------------------------------------------------

    def _prepare(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: bool,
                 logprob_start_len: int | None, top_logprobs_num: int | None, priority: int | None = None,
                 session_params: dict | None = None) -> Prepared:
        return prepare(prompt, sampling_params, input_ids, encode=self.tokenizer.encode, limits=self.scheduler.limits,
                       return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                       top_logprobs_num=top_logprobs_num, priority=priority, session_params=session_params)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDead(f"the scheduler thread died: {self._error!r}") from self._error
        if self._stopped:
            raise EngineDead("the engine is shut down")

    def _submit_all(self, prepared: Prepared, loop: asyncio.AbstractEventLoop | None = None
                    ) -> list[tuple[str, _Waiter]]:
        """One submission per sample: n > 1 becomes n requests that share the prompt through the cache."""
        self._check_alive()
        submitted = []
        for msg in expand(prepared, lambda: f"{uuid.uuid4().hex[:12]}-{next(self._counter)}"):
            waiter = _Waiter(ResponseBuilder(msg.rid, msg.return_logprob, msg.top_logprobs_num), loop)
            with self._lock:
                self._waiters[msg.rid] = waiter
            self.scheduler.submit(msg)
            submitted.append((msg.rid, waiter))
        self._wake.set()
        return submitted

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        priority: int | None = None,
        session_params: dict | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        prepared = self._prepare(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                 top_logprobs_num, priority, session_params)
        if stream and (prepared.batched or prepared.num_sequences != 1):
            raise ValueError("stream=True takes one prompt with n=1")
        submitted = self._submit_all(prepared)
        if stream:
            if len(submitted) != 1:
                raise ValueError("stream=True takes one prompt with n=1")
            return self._stream(*submitted[0])
        results = [self._collect(rid, waiter) for rid, waiter in submitted]
        return results if prepared.batched or len(results) > 1 else results[0]

    def _next(self, waiter: _Waiter, rid: str) -> StrDelta:
        while True:
            try:
                item = waiter.queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._check_running()
                continue
            if isinstance(item, BaseException):
                raise EngineDead(f"the scheduler thread died: {item!r}") from item
            return item

    def _check_running(self) -> None:
        """Raise once no step will ever come: the thread died, or it was shut down."""
        if self._error is not None:
            raise EngineDead(f"the scheduler thread died: {self._error!r}") from self._error
        if not self._thread.is_alive():
            raise EngineDead("the engine is shut down")

    def _collect(self, rid: str, waiter: _Waiter) -> dict:
        try:
            while not waiter.builder.finished:
                waiter.builder.add(self._next(waiter, rid))
        except BaseException:
            self.abort(rid)
            raise
        return self._result(waiter.builder)

    def _stream(self, rid: str, waiter: _Waiter) -> Iterator[dict]:
        try:
            while not waiter.builder.finished:
                waiter.builder.add(self._next(waiter, rid))
                yield self._result(waiter.builder)
        finally:
            if not waiter.builder.finished:
                self.abort(rid)

    @staticmethod
    def _result(builder: ResponseBuilder) -> dict:
        raise_for_finish(builder)
        return builder.to_dict()

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        priority: int | None = None,
        session_params: dict | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        prepared = self._prepare(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                 top_logprobs_num, priority, session_params)
        if stream and (prepared.batched or prepared.num_sequences != 1):
            raise ValueError("stream=True takes one prompt with n=1")
        submitted = self._submit_all(prepared, loop)
        if stream:
            if len(submitted) != 1:
                raise ValueError("stream=True takes one prompt with n=1")
            return self._astream(*submitted[0])
        results = [await self._acollect(rid, waiter) for rid, waiter in submitted]
        return results if prepared.batched or len(results) > 1 else results[0]

    async def _anext(self, waiter: _Waiter) -> StrDelta:
        while True:
            try:
                item = await asyncio.wait_for(waiter.queue.get(), POLL_SECONDS)
            except asyncio.TimeoutError:
                self._check_running()
                continue
            if isinstance(item, BaseException):
                raise EngineDead(f"the scheduler thread died: {item!r}") from item
            return item

    async def _acollect(self, rid: str, waiter: _Waiter) -> dict:
        try:
            while not waiter.builder.finished:
                waiter.builder.add(await self._anext(waiter))
        except BaseException:
            self.abort(rid)
            raise
        return self._result(waiter.builder)

    async def _astream(self, rid: str, waiter: _Waiter) -> AsyncIterator[dict]:
        try:
            while not waiter.builder.finished:
                waiter.builder.add(await self._anext(waiter))
                yield self._result(waiter.builder)
        finally:
            if not waiter.builder.finished:
                self.abort(rid)

    # ----- control ------------------------------------------------------------------------------------

    def abort(self, rid: str) -> None:
        self.scheduler.submit(AbortReq(rid=rid))
        self._wake.set()

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are in flight."""
        if not self.scheduler.idle:
            return False
        return bool(self._call(self.scheduler.flush_cache))

    def _call(self, fn):
        """Run ``fn`` on the scheduler thread between steps and return its result (or raise its error)."""
        from radixrt.scheduler.scheduler import ControlCall

        self._check_alive()
        call = ControlCall(fn)
        self.scheduler.submit(call)
        self._wake.set()
        while not call.done.wait(POLL_SECONDS):
            self._check_running()
        if call.error is not None:
            raise call.error
        return call.result

    def open_session(self, capacity_of_str_len: int | None = None, session_id: str | None = None) -> str:
        """Open a session (SGLang's ``open_session``): pass ``session_params={"id": ...}`` with its requests and
        each one's context stays pinned in the prefix cache for the next turn. Returns its id (``session_id`` if
        given); ValueError for an id already open or a bad capacity."""
        return self._call(lambda: self.scheduler.open_session(capacity_of_str_len, session_id))

    def close_session(self, session_id: str) -> None:
        """Close a session and release its pages to the cache; closing an unknown session does nothing."""
        self._call(lambda: self.scheduler.close_session(session_id))

    def start_profile(self) -> None:
        """Start torch.profiler on the scheduler thread (see radixrt.step_profiler)."""
        self._call(self._profiler.start)

    def stop_profile(self, trace_dir: str | None = None) -> dict[str, dict[str, float]]:
        """Stop it: each operator's self CPU seconds and calls; a Chrome trace in ``trace_dir`` if given."""
        return self._call(lambda: self._profiler.stop(trace_dir))

    def get_model_info(self) -> dict[str, Any]:
        return self.loaded.model_info()

    def get_stats(self) -> dict[str, Any]:
        import msgspec

        return msgspec.structs.asdict(self._call(self.scheduler.stats))

    def shutdown(self) -> None:
        """Stop the scheduler thread (after its current step); calls still waiting raise EngineDead."""
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loaded.close()  # a no-op where the thread already did it
        self._outputs.put(None)
        if threading.current_thread() is not self._detokenizer_thread:
            self._detokenizer_thread.join(timeout=30)
        _LIVE_ENGINES.discard(self)
        self._fail_waiters(EngineDead("the engine is shut down"))

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


@atexit.register
def _shutdown_live_engines() -> None:
    """A script that ends without shutdown(): stop the scheduler threads before the interpreter tears down."""
    for engine in list(_LIVE_ENGINES):
        engine.shutdown()
