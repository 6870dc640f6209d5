"""The one client of the scheduler, shared by the in-process Engine and the server's HTTP process.

Both hosts do the same with the scheduler: prepare a request (tokenize, check it against the model's and the
client's limits), submit it (one GenerateReq per sample), fold the text deltas that come back into one
ResponseBuilder per request and wake whoever waits on it, abort it, and make control calls. Only the transport
differs: ``send`` puts a message into the scheduler's inbox on the Engine's own thread, or pushes it over ZMQ to
the scheduler process. Text deltas arrive through ``on_outputs`` (the Engine's detokenizer thread, the server's
receive loop), control replies through ``on_reply``.

A control call is matched to its reply by a correlation id: ``call(body)`` sends ``ControlReq(id, body)`` and
returns a future that ``on_reply(ControlOut(id, ...))`` completes (a refusal becomes ``RequestError``, anything
else ``RequestFailed``); once the scheduler is gone (``fail_all``) every waiter gets ``RuntimeDown``.

Thread-safety: any method may run on any thread. Shared state sits under one lock; wakers (a thread condition, or
an asyncio event on its loop) are told after it is released.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Callable, Protocol

from radixrt.metrics import RequestMetrics
from radixrt.protocol.errors import Overloaded, RequestError, RequestFailed, RuntimeDown, error_for
from radixrt.protocol.limits import NO_LIMITS, ClientLimits, ModelLimits
from radixrt.protocol.messages import (
    AbortReq,
    BatchStrOut,
    Control,
    ControlOut,
    ControlReq,
    MemoryOut,
    PauseOut,
    WeightsOut,
)
from radixrt.protocol.request import GenerateInput, Prepared, expand, prepare
from radixrt.response import ResponseBuilder

logger = logging.getLogger("radixrt.client")


class Waker(Protocol):
    def wake(self) -> None: ...


class ThreadWaker:
    """For callers that block a thread: ``wait`` returns once woken (or after ``timeout``)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        woken = self._event.wait(timeout)
        self._event.clear()
        return woken


class LoopWaker:
    """For coroutines on ``loop``: ``await wait()`` returns once woken; ``wake`` may come from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.event = asyncio.Event()

    def wake(self) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.event.set()
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class Handle:
    """One submitted request: its ResponseBuilder, timings, and the waker of the call it belongs to."""

    __slots__ = ("rid", "builder", "waker", "index", "created", "first_token_at", "last_token_at", "error",
                 "prompt_ids")

    def __init__(self, rid: str, builder: ResponseBuilder, waker: Waker, index: int) -> None:
        self.rid = rid
        self.builder = builder
        self.waker = waker  # shared by the requests of one call, so one waiter sees them all
        self.index = index
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.error: str | None = None  # set when the runtime is gone
        self.prompt_ids: list[int] | None = None  # kept only to log requests

    @property
    def finished(self) -> bool:
        return self.builder.finished or self.error is not None

    def request_error(self) -> str | None:
        """The message of an abort that refused the request (a 4xx)."""
        reason = self.builder.finish_reason
        return reason.message if reason is not None and reason.is_error and not reason.is_server_error else None

    def server_error(self) -> str | None:
        """The message of a failure inside the runtime while serving this request (a 500)."""
        reason = self.builder.finish_reason
        return reason.message if reason is not None and reason.is_server_error else None

    def raise_for_failure(self) -> None:
        """RuntimeDown, RequestError or RequestFailed for a request that ended in one (a client's own abort is
        not a failure)."""
        if self.error is not None:
            raise RuntimeDown(self.error)
        message = self.request_error()
        if message is not None:
            raise error_for(self.builder.finish_reason.status_code or 400, message)
        message = self.server_error()
        if message is not None:
            raise RequestFailed(message)


def raise_for_failures(handles: list[Handle]) -> None:
    """The most serious failure among ``handles``: the runtime's, then a refusal, then a failure serving one."""
    for kind in ("error", "request", "server"):
        for h in handles:
            if kind == "error" and h.error is not None or kind == "request" and h.request_error() is not None \
                    or kind == "server" and h.server_error() is not None:
                h.raise_for_failure()


class SchedulerClient:
    def __init__(self, send: Callable[[object], None], encode: Callable[[str], list[int]],
                 limits: Callable[[], ModelLimits], client_limits: Callable[[], ClientLimits] = lambda: NO_LIMITS,
                 max_in_flight: int | None = None, on_finished: Callable[[Handle, float], None] | None = None) -> None:
        """``send`` delivers a message to the scheduler; ``limits`` and ``client_limits`` are read per request (the
        server learns them in its start-up handshake); ``max_in_flight`` bounds the requests in flight (more are
        ``Overloaded``); ``on_finished`` is told of each finished request (the server logs it)."""
        self.send = send
        self.encode = encode
        self.limits = limits
        self.client_limits = client_limits
        self.max_in_flight = max_in_flight
        self.on_finished = on_finished
        self.metrics = RequestMetrics()
        self.handles: dict[str, Handle] = {}
        self.dead: str | None = None  # why the scheduler cannot answer any more
        self.keep_prompts = False  # keep each request's prompt ids (to log them)
        self._lock = threading.Lock()
        self._rids = itertools.count()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count(1)
        # what updates of weights changed in the model's info (model_path, weight_version), from their replies
        self.weights_info: dict[str, str] = {}
        self.paused = False  # as the latest pause or continue left the scheduler (radixrt.scheduler.weights)
        self.released: list[str] = []  # memory given back, as the latest release or resume left it (occupation)

    # ----- requests -----------------------------------------------------------------------------------

    def prepare(self, req: GenerateInput) -> Prepared:
        """The one request path (radixrt.protocol.request.prepare) with this host's limits. Blocking (it tokenizes
        text): the server calls it off its event loop."""
        return prepare(req, encode=self.encode, limits=self.limits(), client_limits=self.client_limits())

    def check_capacity(self, new_requests: int) -> None:
        if self.dead is not None:
            raise RuntimeDown(self.dead)
        if self.max_in_flight is not None and len(self.handles) + new_requests > self.max_in_flight:
            self.metrics.requests_rejected += 1
            raise Overloaded(f"the server is overloaded: {len(self.handles)} requests in flight and at most "
                             f"{self.max_in_flight} may be; retry later")

    def submit(self, prepared: Prepared, waker: Waker) -> list[Handle]:
        """One submission per sample: n > 1 becomes n requests sharing the prompt. ``prepared`` is checked."""
        messages = expand(prepared, lambda: f"{uuid.uuid4().hex[:12]}-{next(self._rids)}")
        with self._lock:
            if any(msg.rid in self.handles for msg in messages):
                raise RequestError("rid must be unique among the requests in flight")
            self.check_capacity(len(messages))
            handles = []
            for i, msg in enumerate(messages):
                handle = Handle(msg.rid, ResponseBuilder(msg.rid, prepared.return_logprob, msg.top_logprobs_num,
                                                         msg.token_ids_logprob is not None),
                                waker, i)
                if self.keep_prompts:
                    handle.prompt_ids = msg.input_ids
                self.handles[msg.rid] = handle
                handles.append(handle)
            self.metrics.requests_received += len(handles)
        for msg in messages:
            self.send(msg)
        return handles

    def on_outputs(self, batch: BatchStrOut) -> None:
        """Fold text deltas into their requests and wake their waiters."""
        now = time.perf_counter()
        wake: dict[int, Waker] = {}
        failed_after: list[str] = []
        finished: list[Handle] = []
        with self._lock:
            for out in batch.outputs:
                handle = self.handles.get(out.rid)
                if handle is None:
                    continue  # aborted by its caller already
                handle.builder.add(out)
                self.metrics.observe_tokens(handle, len(out.delta.new_ids), now)
                if handle.builder.finished:
                    del self.handles[out.rid]
                    self.metrics.observe_finished(handle, now)
                    finished.append(handle)
                    if handle.server_error() is not None:  # failed past the scheduler: free its pages there too
                        failed_after.append(out.rid)
                wake[id(handle.waker)] = handle.waker
        for rid in failed_after:
            self.send(AbortReq(rid=rid))
        if self.on_finished is not None:
            for handle in finished:
                self.on_finished(handle, now)
        for waker in wake.values():
            waker.wake()

    def snapshot(self, handle: Handle) -> dict:
        """The request's response so far (SGLang's native dict), consistent even while deltas arrive."""
        with self._lock:
            return handle.builder.to_dict()

    def progress(self, handle: Handle) -> tuple[int, int, bool]:
        """(output ids, text characters, finished): changes whenever the request's response does."""
        with self._lock:
            return len(handle.builder.output_ids), len(handle.builder.text), handle.finished

    def abort(self, rid: str) -> bool:
        """Ask the scheduler to drop ``rid``; it then finishes (reason abort) through the usual output path."""
        with self._lock:
            known = rid in self.handles
        if known:
            self.send(AbortReq(rid=rid))
        return known

    def abort_unfinished(self, handles: list[Handle]) -> None:
        for h in handles:
            if not h.finished:
                self.abort(h.rid)

    def abort_all(self) -> int:
        with self._lock:
            rids = list(self.handles)
        for rid in rids:
            self.send(AbortReq(rid=rid))
        return len(rids)

    # ----- control calls ------------------------------------------------------------------------------

    def call(self, body: Control) -> Future:
        """Send a control call; the future gets its reply's body (or RequestError / RequestFailed / RuntimeDown)."""
        future: Future = Future()
        with self._lock:
            if self.dead is not None:
                future.set_exception(RuntimeDown(self.dead))
                return future
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self.send(ControlReq(id=call_id, body=body))
        return future

    def on_reply(self, reply: ControlOut) -> None:
        with self._lock:
            future = self._calls.pop(reply.id, None)
        if isinstance(reply.body, WeightsOut):  # also when its caller gave up waiting
            self.weights_info = {"model_path": reply.body.model_path, "weight_version": reply.body.weight_version}
        elif isinstance(reply.body, PauseOut):
            self.paused = reply.body.paused
        elif isinstance(reply.body, MemoryOut):
            self.released = list(reply.body.released)
            self.weights_info["weight_version"] = reply.body.weight_version
        if future is None or future.done():
            return  # its caller gave up waiting
        if reply.error is None:
            future.set_result(reply.body)
        else:
            future.set_exception(error_for(reply.status_code, reply.error))

    # ----- the scheduler is gone ----------------------------------------------------------------------

    def fail_all(self, message: str) -> None:
        """Wake every waiter with RuntimeDown; later calls fail at once."""
        with self._lock:
            self.dead = message
            handles, self.handles = list(self.handles.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for handle in handles:
            handle.error = message
            handle.waker.wake()
        for future in calls:
            if not future.done():
                future.set_exception(RuntimeDown(message))
