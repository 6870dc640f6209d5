"""The scheduler process: owns the model, the KV page pool and the radix cache.

Loop: take every message waiting on its PULL socket (requests, aborts, control calls) into the scheduler, run
one scheduler step, and push that step's token deltas to the detokenizer as one BatchTokenOut and the replies
to control calls back to the HTTP process. When there is
nothing to do it blocks on the socket (no spinning). It gets the machine's compute threads.
Under tensor parallelism it is rank 0: it spawns the follower ranks (``LoadedModel.load``), checks them
before every step and exits with code 1 when one died, which the launcher turns into the server's exit.

Run by the server launcher: ``python -m radixrt.server.scheduler_process ARGS_JSON IPC_DIR PARENT_PID``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import zmq

from radixrt.protocol.messages import ControlOut, SchedulerReady
from radixrt.server.ipc import ENCODER, IpcPaths, SchedulerInbound, decoder
from radixrt.procs import die_with_parent, parent_alive
from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.scheduler_process")

class SchedulerProcess:
    def __init__(self, args: ServerArgs, paths: IpcPaths, parent_pid: int) -> None:
        from radixrt.loaded_model import LoadedModel
        from radixrt.scheduler.scheduler import Scheduler

        self.args = args
        self.parent_pid = parent_pid
        loaded = self.loaded = LoadedModel.load(args)
        self.model_path, self.tokenizer, self.runner = loaded.model_path, loaded.tokenizer, loaded.runner
        self.eos_ids = loaded.eos_ids
        grammars = loaded.grammars

        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(paths.scheduler_in)
        self.to_detokenizer = self.ctx.socket(zmq.PUSH)
        self.to_detokenizer.connect(paths.detokenizer_in)
        self.to_tokenizer = self.ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(paths.tokenizer_in)
        for sock in (self.inbox, self.to_detokenizer, self.to_tokenizer):
            sock.setsockopt(zmq.LINGER, 0)
        self.decode = decoder(SchedulerInbound).decode

        self.scheduler = Scheduler(args, self.runner, self.tokenizer, self.eos_ids, self._sink, grammars)
        self.running = True
        limits = self.scheduler.limits
        self.to_tokenizer.send(ENCODER.encode(SchedulerReady(
            pid=os.getpid(),
            model_info=loaded.model_info(),
            vocab_size=self.runner.config.vocab_size,
            context_length=self.runner.context_length,
            page_size=self.runner.page_size,
            num_pages=self.runner.pool.num_pages,
            generates=limits.generates,
            embedding_size=limits.embedding_size,
            matryoshka=None if limits.matryoshka is None else list(limits.matryoshka),
        )))

    def _sink(self, msg) -> None:
        """The scheduler's outbox: token deltas to the detokenizer, control replies to the HTTP process."""
        (self.to_tokenizer if isinstance(msg, ControlOut) else self.to_detokenizer).send(ENCODER.encode(msg))

    def _drain(self, timeout_ms: int) -> bool:
        """Handle every waiting message, blocking up to ``timeout_ms`` for the first one."""
        got = False
        if timeout_ms and not self.inbox.poll(timeout_ms):
            return False
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True
            try:
                msg = self.decode(frame)
            except Exception:  # a malformed frame is that frame's problem, not the server's
                logger.exception("dropped a message the scheduler cannot decode")
                continue
            self.scheduler.submit(msg)

    def run(self) -> None:
        busy = False
        last_parent_check = time.monotonic()
        while self.running:
            # Idle: block on the socket. Waiting on a grammar compile or similar: poll briefly.
            timeout = 0 if busy else (5 if not self.scheduler.idle else 1000)
            self._drain(timeout)
            self.loaded.check_ranks()
            busy = self.scheduler.step()
            now = time.monotonic()
            if now - last_parent_check > 1.0:
                last_parent_check = now
                if not parent_alive(self.parent_pid):
                    logger.warning("the server process is gone; exiting")
                    return

    def close(self) -> None:
        self.scheduler.close()
        self.loaded.close()
        for sock in (self.inbox, self.to_detokenizer, self.to_tokenizer):
            sock.close(0)
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args_json, ipc_dir, parent_pid = argv[0], argv[1], int(argv[2])
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server shuts us down

    def _term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    args = ServerArgs(**json.loads(args_json))
    logging.basicConfig(level=args.log_level.upper(), format="[scheduler %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    proc = None
    try:
        proc = SchedulerProcess(args, IpcPaths(ipc_dir), parent_pid)
        proc.run()
    except SystemExit:
        pass
    except BaseException:
        logger.exception("the scheduler process failed")
        if proc is not None and proc.loaded.world is not None:
            proc.loaded.world.abort()
        return 1
    finally:
        if proc is not None:
            proc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
