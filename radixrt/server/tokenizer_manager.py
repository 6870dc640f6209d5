"""The HTTP process's side of the runtime: the scheduler's client over ZMQ, and the start-up handshake.

Requests are prepared and validated here by the one client of the scheduler (radixrt.client.SchedulerClient, the
Engine's too) with the limits the scheduler process reports in its handshake, so a bad request is answered 400
without a round trip and with the same message the in-process Engine gives. The client folds each request's
text deltas into a ResponseBuilder (so /generate returns the Engine's dict) and matches control replies to their
calls; this class gives it its transport (a ZMQ PUSH to the scheduler, a PULL loop for what comes back) and runs
the blocking work (tokenizing, templating) off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import zmq
import zmq.asyncio

from radixrt.client import Handle, LoopWaker, SchedulerClient
from radixrt.protocol.errors import RuntimeDown
from radixrt.protocol.limits import ClientLimits, ModelLimits
from radixrt.protocol.messages import BatchStrOut, Control, ControlOut, DetokenizerReady, SchedulerReady
from radixrt.protocol.request import GenerateInput, Prepared
from radixrt.server.ipc import ENCODER, IpcPaths, TokenizerInbound, decoder
from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.tokenizer_manager")
T = TypeVar("T")


class TokenizerManager:
    def __init__(self, args: ServerArgs, paths: IpcPaths, tokenizer) -> None:
        self.args = args
        self.paths = paths
        self.tokenizer = tokenizer
        self.ready: SchedulerReady | None = None
        self.detokenizer_ready: DetokenizerReady | None = None
        self.client = SchedulerClient(self._push, encode=tokenizer.encode, limits=lambda: self.limits,
                                      client_limits=lambda: self.client_limits,
                                      max_in_flight=args.max_running_requests + args.max_queued_requests,
                                      on_finished=self._log_finished)
        self.client.keep_prompts = args.log_requests
        self.metrics = self.client.metrics
        self._ready_event: asyncio.Event | None = None
        self._token_text_cache: dict[int, str] = {}
        # The loaded LoRA adapters' names -> paths: those of --lora-paths (the scheduler loads them all or does not
        # start), then as /load_lora_adapter and /unload_lora_adapter leave them.
        self.lora_adapters: dict[str, str] = dict(args.lora_adapters())
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

    def _push(self, msg: object) -> None:
        """The client's transport to the scheduler process (called on the event loop's thread)."""
        self.to_scheduler.send(ENCODER.encode(msg))

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
                    self.client.on_outputs(msg)
                elif isinstance(msg, ControlOut):
                    self.client.on_reply(msg)
                elif isinstance(msg, SchedulerReady):
                    self.ready = msg
                elif isinstance(msg, DetokenizerReady):
                    self.detokenizer_ready = msg
                if self.ready is not None and self.detokenizer_ready is not None:
                    self._ready_event.set()
            except Exception:  # a bad message must not stop the server from answering everyone else
                logger.exception("could not handle a message from the runtime")

    def _log_finished(self, state: Handle, now: float) -> None:
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
        return {**self.ready.model_info, **self.client.weights_info}

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

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text_cache[token_id] = text
        return text

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits.of_ready(self.ready)

    @property
    def client_limits(self) -> ClientLimits:
        return ClientLimits.of_server(self.args, self.ready.context_length)

    # ----- requests and control calls (radixrt.client) -------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.client.handles)

    def prepare(self, req: GenerateInput) -> Prepared:
        """The one request path of every route with this server's limits. Blocking (it tokenizes text): call it
        through ``off_loop``."""
        return self.client.prepare(req)

    def submit(self, prepared: Prepared) -> list[Handle]:
        """Submit a prepared request (one per sample); its handles share one waker on this event loop."""
        return self.client.submit(prepared, LoopWaker())

    def abort(self, rid: str) -> bool:
        return self.client.abort(rid)

    def abort_unfinished(self, handles: list[Handle]) -> None:
        self.client.abort_unfinished(handles)

    def abort_all(self) -> int:
        return self.client.abort_all()

    def fail_all(self, message: str) -> None:
        """The runtime is gone: wake every waiter with an error."""
        self.client.fail_all(message)

    async def call(self, body: Control, timeout: float = 30.0) -> Any:
        """A control call to the scheduler (radixrt/scheduler/control.py): its reply's body."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.client.call(body)), timeout)
        except asyncio.TimeoutError:
            raise RuntimeDown("the scheduler did not answer in time") from None
