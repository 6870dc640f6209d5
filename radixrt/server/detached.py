"""An Engine's scheduler and detokenizer in processes of their own, as `radixrt serve` runs them.

``Engine(engine_scheduler="process")`` (the default on CUDA) keeps only its client in the caller's process:
the scheduler process owns the model, the KV pool and the radix cache and steps without sharing a GIL with the
caller's threads or the detokenizer, which is what a GPU step must not wait for (at batch 256 the Engine's
threads together took about twice the scheduler's own host time a step). ``DetachedRuntime`` is the Engine's
transport to them:

- start-up: the scheduler is spawned (radixrt.server.runtime_procs), the caller's tokenizer loaded
  (``load_tokenizer``, while the scheduler loads the model; kept as ``tokenizer``), the detokenizer spawned with it,
  and their handshake awaited; a helper that exits first raises ``RuntimeError`` with its exit code (its log says
  why), an error of ``load_tokenizer`` stops the scheduler and propagates;
- ``send``: a message to the scheduler (any thread; ZMQ sockets are not thread-safe, so under a lock);
- a receiver thread hands every text delta and control reply to ``deliver``; once a helper has died it calls
  ``fail`` with what happened, and ``problem`` says it from then on;
- ``close``: stop the receiver, then the helpers (SIGTERM, then SIGKILL), and remove the ipc folder.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Callable

import zmq

from radixrt.procs import stop_processes
from radixrt.protocol.limits import ModelLimits
from radixrt.protocol.messages import DetokenizerReady, SchedulerReady
from radixrt.server.ipc import ENCODER, IpcPaths, TokenizerInbound, decoder
from radixrt.server.runtime_procs import dead_helper, spawn_detokenizer, spawn_scheduler
from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.engine")

POLL_MS = 200  # how often the receiver looks at the helpers while nothing arrives


class DetachedRuntime:
    def __init__(self, args: ServerArgs, load_tokenizer: Callable[[], Any], tokenizer_path: str,
                 deliver: Callable[[object], None], fail: Callable[[str], None]) -> None:
        self._deliver, self._fail = deliver, fail
        self._ipc_dir = tempfile.mkdtemp(prefix="radixrt-engine-")
        paths = IpcPaths(self._ipc_dir)
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(paths.tokenizer_in)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.connect(paths.scheduler_in)
        for sock in (self._inbox, self._outbox):
            sock.setsockopt(zmq.LINGER, 0)
        self._decode = decoder(TokenizerInbound).decode
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self._procs: dict[str, subprocess.Popen] = {}
        try:
            self._procs["scheduler"] = spawn_scheduler(args, self._ipc_dir)  # it loads the model meanwhile
            self.tokenizer = load_tokenizer()
            self._procs["detokenizer"] = spawn_detokenizer(args, self._ipc_dir, self.tokenizer, tokenizer_path)
            self.ready = self._handshake()
        except BaseException:
            self.close()
            raise
        self._receiver = threading.Thread(target=self._receive, name="radixrt-receiver", daemon=True)
        self._receiver.start()

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits.of_ready(self.ready)

    def problem(self) -> str | None:
        """Why the runtime cannot serve any more (a helper exited), or None."""
        return dead_helper(self._procs)

    def send(self, msg: object) -> None:
        frame = ENCODER.encode(msg)
        with self._send_lock:
            self._outbox.send(frame)

    def _handshake(self) -> SchedulerReady:
        scheduler_ready = detokenizer_ready = None
        while scheduler_ready is None or detokenizer_ready is None:
            problem = dead_helper(self._procs)
            if problem is not None:
                raise RuntimeError(f"the engine's runtime failed to start: {problem} (its log above says why)")
            if not self._inbox.poll(POLL_MS):
                continue
            msg = self._decode(self._inbox.recv())
            if isinstance(msg, SchedulerReady):
                scheduler_ready = msg
            elif isinstance(msg, DetokenizerReady):
                detokenizer_ready = msg
        return scheduler_ready

    def _receive(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._inbox.poll(POLL_MS):
                    problem = dead_helper(self._procs)
                    if problem is not None and not self._stopping.is_set():
                        logger.error("%s; the engine cannot serve any more", problem)
                        self._fail(problem)
                        return
                    continue
                self._deliver(self._decode(self._inbox.recv()))
            except zmq.ZMQError:
                if self._stopping.is_set():
                    return
                raise
            except Exception:  # one bad message must not strand every later caller
                logger.exception("could not handle a message from the engine's runtime")

    def close(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(timeout=5)
        stop_processes(list(self._procs.values()))
        self._inbox.close(0)
        self._outbox.close(0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
