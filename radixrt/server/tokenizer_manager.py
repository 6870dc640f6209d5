"""The HTTP process's side of the runtime: tokenize, validate, submit over ZMQ, and gather text deltas.

Requests are prepared and validated here by the Engine's own request path (radixrt.requests), using the
limits the scheduler process reports in its startup handshake, so a bad request is answered 400 without a
round trip and with the same message the in-process Engine gives.
Each request's deltas fold into a ResponseBuilder (the Engine's, so /generate returns the Engine's dict).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import msgspec
import zmq
import zmq.asyncio

from radixrt.messages import (
    AbortReq,
    BatchStrOut,
    CloseSessionOut,
    CloseSessionReq,
    DetokenizerReady,
    FlushCacheOut,
    FlushCacheReq,
    OpenSessionOut,
    OpenSessionReq,
    SchedulerReady,
    StatsOut,
    StatsReq,
)
from radixrt.response import ResponseBuilder
from radixrt.requests import ClientLimits, Prepared, expand, prepare
from radixrt.scheduler.validation import ModelLimits, RequestError
from radixrt.server.ipc import ENCODER, IpcPaths, TokenizerInbound, decoder
from radixrt.server.metrics import Metrics
from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.tokenizer_manager")
T = TypeVar("T")


class Overloaded(RuntimeError):
    """The waiting queue is full (HTTP 503)."""


class ServerDown(RuntimeError):
    """The scheduler or detokenizer process is gone (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The runtime failed while serving this request (its batch's forward, its output); others go on (HTTP 500)."""


class ReqState:
    __slots__ = ("rid", "builder", "event", "created", "first_token_at", "last_token_at", "error", "index",
                 "prompt_ids")

    def __init__(self, rid: str, builder: ResponseBuilder, event: asyncio.Event, index: int) -> None:
        self.rid = rid
        self.builder = builder
        self.event = event  # shared by the requests of one HTTP call, so one waiter sees them all
        self.index = index
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.error: str | None = None  # set when the server side failed (not a request error)
        self.prompt_ids: list[int] | None = None  # kept only with --log-requests

    @property
    def finished(self) -> bool:
        return self.builder.finished or self.error is not None

    def request_error(self) -> str | None:
        """The message of an abort that the runtime raised for a bad request (Engine raises ValueError)."""
        reason = self.builder.finish_reason
        return reason.message if reason is not None and reason.is_error and not reason.is_server_error else None

    def server_error(self) -> str | None:
        """The message of a failure inside the runtime while serving this request (HTTP 500)."""
        reason = self.builder.finish_reason
        return reason.message if reason is not None and reason.is_server_error else None


class TokenizerManager:
    def __init__(self, args: ServerArgs, paths: IpcPaths, tokenizer) -> None:
        self.args = args
        self.paths = paths
        self.tokenizer = tokenizer
        self.states: dict[str, ReqState] = {}
        self.metrics = Metrics()
        self.ready: SchedulerReady | None = None
        self.detokenizer_ready: DetokenizerReady | None = None
        self.dead: str | None = None  # why the server cannot serve any more
        self._counter = itertools.count()
        self._stats_waiters: deque[asyncio.Future] = deque()
        self._flush_waiters: deque[asyncio.Future] = deque()
        self._open_session_waiters: deque[asyncio.Future] = deque()
        self._close_session_waiters: deque[asyncio.Future] = deque()
        self._ready_event: asyncio.Event | None = None
        self._token_text_cache: dict[int, str] = {}
        # Tokenizing, chat templating and detokenizing run here, off the event loop: a large request costs
        # only its own latency, never the other clients'.
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixrt-tokenize")

    # ----- sockets ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(self.paths.tokenizer_in)
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.connect(self.paths.scheduler_in)
        for sock in (self.inbox, self.to_scheduler):
            sock.setsockopt(zmq.LINGER, 0)
        self._decode = decoder(TokenizerInbound).decode
        self._ready_event = asyncio.Event()
        self._recv_task = asyncio.create_task(self._receive_loop())

    async def wait_ready(self) -> None:
        await self._ready_event.wait()

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking work (tokenizing, templating, decoding) in the worker threads."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        task = getattr(self, "_recv_task", None)
        if task is not None:
            task.cancel()
        if hasattr(self, "ctx"):
            self.inbox.close(0)
            self.to_scheduler.close(0)
            self.ctx.term()

    async def _receive_loop(self) -> None:
        while True:
            frame = await self.inbox.recv()
            try:
                msg = self._decode(frame)
                if isinstance(msg, BatchStrOut):
                    self._on_outputs(msg)
                elif isinstance(msg, StatsOut):
                    if self._stats_waiters:
                        fut = self._stats_waiters.popleft()
                        if not fut.done():
                            fut.set_result(msg)
                elif isinstance(msg, FlushCacheOut):
                    if self._flush_waiters:
                        fut = self._flush_waiters.popleft()
                        if not fut.done():
                            fut.set_result(msg.ok)
                elif isinstance(msg, (OpenSessionOut, CloseSessionOut)):
                    waiters = (self._open_session_waiters if isinstance(msg, OpenSessionOut)
                               else self._close_session_waiters)
                    if waiters:
                        fut = waiters.popleft()
                        if not fut.done():
                            fut.set_result(msg)
                elif isinstance(msg, SchedulerReady):
                    self.ready = msg
                elif isinstance(msg, DetokenizerReady):
                    self.detokenizer_ready = msg
                if self.ready is not None and self.detokenizer_ready is not None:
                    self._ready_event.set()
            except Exception:  # a bad message must not stop the server from answering everyone else
                logger.exception("could not handle a message from the runtime")

    def _on_outputs(self, batch: BatchStrOut) -> None:
        now = time.perf_counter()
        touched: set[int] = set()
        for out in batch.outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue  # aborted by us already
            state.builder.add(out)
            n_new = len(out.delta.new_ids)
            if n_new:
                if state.first_token_at is None:
                    state.first_token_at = now
                    self.metrics.ttft.observe(now - state.created)
                    if n_new > 1:
                        self.metrics.itl.observe(0.0, n_new - 1)
                else:
                    self.metrics.itl.observe((now - state.last_token_at) / n_new, n_new)
                state.last_token_at = now
            if state.builder.finished:
                del self.states[out.rid]
                self._count_finished(state, now)
                self._log_finished(state, now)
                if state.server_error() is not None:  # failed after the scheduler (detokenizer): free its pages
                    self.to_scheduler.send(ENCODER.encode(AbortReq(rid=out.rid)))
            if id(state.event) not in touched:
                touched.add(id(state.event))
                state.event.set()

    def _count_finished(self, state: ReqState, now: float) -> None:
        m = self.metrics
        meta = state.builder.meta
        reason = state.builder.finish_reason
        if state.request_error() is not None or state.server_error() is not None:
            m.requests_failed += 1
            return
        if reason is not None and reason.type == "abort":
            m.requests_aborted += 1
        m.requests_finished += 1
        m.prompt_tokens += meta.get("prompt_tokens", 0)
        m.generation_tokens += meta.get("completion_tokens", 0)
        m.cached_tokens += meta.get("cached_tokens", 0)
        m.e2e.observe(now - state.created)

    def _log_finished(self, state: ReqState, now: float) -> None:
        """One line a request: sizes, timings and outcome; its text only with --log-requests."""
        meta = state.builder.meta
        reason = state.builder.finish_reason
        outcome = reason.type if reason is not None else None
        line = (f"request {state.rid}: {outcome} after {now - state.created:.3f} s, "
                f"prompt {meta.get('prompt_tokens', 0)} tokens ({meta.get('cached_tokens', 0)} cached), "
                f"output {meta.get('completion_tokens', 0)} tokens")
        if reason is not None and reason.is_error:
            line += f", error {reason.status_code or 400}"
        if self.args.log_requests:
            prompt = self.tokenizer.decode(state.prompt_ids) if state.prompt_ids else ""
            line += f"; prompt {prompt!r}; output {state.builder.text!r}"
        logger.info("%s", line)

    # ----- the model's limits -------------------------------------------------------------------------

    @property
    def model_info(self) -> dict[str, Any]:
        return dict(self.ready.model_info)

    @property
    def context_length(self) -> int:
        return self.ready.context_length

    @property
    def vocab_size(self) -> int:
        return self.ready.vocab_size

    def served_names(self) -> set[str]:
        info = self.ready.model_info
        return {info["served_model_name"], self.args.model, info["model_path"]}

    def max_new_tokens_default(self, prompt_len: int) -> int:
        """OpenAI's "up to the context": the longest output the context and the KV pool both allow."""
        r = self.ready
        return max(min(r.context_length, (r.num_pages - 1) * r.page_size) - prompt_len, 0)

    # ----- preparing requests -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text_cache[token_id] = text
        return text

    @property
    def limits(self) -> ModelLimits:
        r = self.ready
        return ModelLimits(vocab_size=r.vocab_size, context_length=r.context_length, page_size=r.page_size,
                           num_pages=r.num_pages)

    @property
    def client_limits(self) -> ClientLimits:
        return ClientLimits.of_server(self.args, self.ready.context_length)

    def prepare(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: bool = False,
                logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                priority: int | None = None, session_params: Any = None) -> Prepared:
        """The one request path of every route (radixrt.requests.prepare) with this server's limits: exactly one
        of text and input_ids; one params dict or one per prompt; every sequence validated with its logprob
        options. Blocking (it tokenizes text): call it through ``off_loop``."""
        return prepare(prompt, sampling_params, input_ids, encode=self.encode, limits=self.limits,
                       return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                       top_logprobs_num=top_logprobs_num, client_limits=self.client_limits, priority=priority,
                       session_params=session_params)

    # ----- submitting ---------------------------------------------------------------------------------

    def check_capacity(self, new_requests: int) -> None:
        if self.dead is not None:
            raise ServerDown(self.dead)
        waiting = len(self.states) + new_requests - self.args.max_running_requests
        if waiting > self.args.max_queued_requests:
            self.metrics.requests_rejected += 1
            raise Overloaded(
                f"the server is overloaded: {len(self.states)} requests in flight and the waiting queue holds at "
                f"most {self.args.max_queued_requests}; retry later"
            )

    def submit_all(self, prepared: Prepared, rids: list[str] | None = None) -> list[ReqState]:
        """One submission per sample (radixrt.requests.expand): n > 1 becomes n requests sharing the prompt.
        ``prepared`` comes from ``prepare``: it is checked already."""
        messages = expand(prepared, lambda: f"{uuid.uuid4().hex[:12]}-{next(self._counter)}", rids)
        if rids is not None and any(r in self.states for r in rids):
            raise RequestError("rid must be unique among the requests in flight")
        self.check_capacity(len(messages))
        event = asyncio.Event()
        states = []
        for i, msg in enumerate(messages):
            builder = ResponseBuilder(msg.rid, prepared.return_logprob, msg.top_logprobs_num)
            state = ReqState(msg.rid, builder, event, i)
            if self.args.log_requests:
                state.prompt_ids = msg.input_ids
            self.states[msg.rid] = state
            self.to_scheduler.send(ENCODER.encode(msg))
            states.append(state)
        self.metrics.requests_received += len(states)
        return states

    def abort(self, rid: str) -> bool:
        """Ask the scheduler to drop ``rid`` (its pages are freed on its next step). The request then finishes
        with reason abort through the normal output path, which wakes its waiter."""
        if rid not in self.states:
            return False
        self.to_scheduler.send(ENCODER.encode(AbortReq(rid=rid)))
        return True

    def abort_unfinished(self, states: list[ReqState]) -> None:
        for s in states:
            if not s.finished:
                self.abort(s.rid)

    def abort_all(self) -> int:
        rids = list(self.states)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def fail_all(self, message: str) -> None:
        """The runtime is gone: wake every waiter with an error."""
        self.dead = message
        for state in list(self.states.values()):
            state.error = message
            state.event.set()
        self.states.clear()
        for waiters in (self._stats_waiters, self._flush_waiters, self._open_session_waiters,
                        self._close_session_waiters):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(ServerDown(message))

    # ----- control ------------------------------------------------------------------------------------

    async def _control(self, msg, waiters: deque, timeout: float) -> Any:
        if self.dead is not None:
            raise ServerDown(self.dead)
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        self.to_scheduler.send(ENCODER.encode(msg))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise ServerDown("the scheduler did not answer in time") from None

    async def stats(self, timeout: float = 10.0) -> StatsOut:
        return await self._control(StatsReq(), self._stats_waiters, timeout)

    async def flush_cache(self, timeout: float = 30.0) -> bool:
        return await self._control(FlushCacheReq(), self._flush_waiters, timeout)

    async def open_session(self, capacity_of_str_len: int | None = None, session_id: str | None = None,
                           timeout: float = 30.0) -> str:
        """Open a session in the scheduler; RequestError (400) for an id already open or a bad value."""
        out = await self._control(OpenSessionReq(capacity_of_str_len, session_id), self._open_session_waiters,
                                  timeout)
        if out.session_id is None:
            raise RequestError(out.error or "the session could not be opened")
        return out.session_id

    async def close_session(self, session_id: str, timeout: float = 30.0) -> bool:
        """Close a session (its pages become ordinary cache); False if it was not open."""
        out = await self._control(CloseSessionReq(session_id), self._close_session_waiters, timeout)
        return out.closed

    def stats_dict(self, out: StatsOut) -> dict[str, Any]:
        return msgspec.structs.asdict(out.stats)
