"""The detokenizer process: BatchTokenOut (token ids per request per step) -> BatchStrOut (text deltas).

Incremental decoding (partial UTF-8 held back) and stop strings come from radixrt.detokenize.Detokenizer,
the same code the in-process Engine uses. One output message per input message (per scheduler step).
Pinned to one thread: it must not compete with the scheduler for cores.

Run by the server launcher: ``python -m radixrt.server.detokenizer_process TOKENIZER IPC_DIR PARENT_PID``, where
TOKENIZER is the Rust tokenizer's JSON file where that decodes the same text (it then starts in a fraction of a
second, without transformers and torch), else the tokenizer's folder.
"""

from __future__ import annotations

from radixrt.procs import pin_helper_threads

pin_helper_threads()  # before anything can import torch

import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import zmq  # noqa: E402

from radixrt.protocol.messages import BatchTokenOut, DetokenizerReady  # noqa: E402
from radixrt.procs import die_with_parent, parent_alive, torch_single_thread  # noqa: E402
from radixrt.server.ipc import ENCODER, IpcPaths, decoder  # noqa: E402

logger = logging.getLogger("radixrt.detokenizer_process")


def load_decoder(source: str):
    """What the detokenizer decodes with: the Rust tokenizer in ``source`` where it is a ``.json`` file (written
    by radixrt.server.runtime_procs; no transformers, no torch), else the tokenizer in that folder."""
    if source.endswith(".json"):
        from radixrt.detokenize import RustDecoder

        with open(source) as file:
            return RustDecoder(file.read())
    from radixrt.tokenizer import load_tokenizer

    return load_tokenizer(source)


def run(tokenizer_source: str, paths: IpcPaths, parent_pid: int) -> None:
    from radixrt.detokenize import Detokenizer

    tokenizer = load_decoder(tokenizer_source)
    torch_single_thread()
    detokenizer = Detokenizer(tokenizer)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(paths.detokenizer_in)
    out = ctx.socket(zmq.PUSH)
    out.connect(paths.tokenizer_in)
    for sock in (inbox, out):
        sock.setsockopt(zmq.LINGER, 0)
    decode = decoder(BatchTokenOut).decode
    out.send(ENCODER.encode(DetokenizerReady(pid=os.getpid())))
    try:
        while True:
            if not inbox.poll(1000):
                if not parent_alive(parent_pid):
                    return
                continue
            batch = decode(inbox.recv())
            out.send(ENCODER.encode(detokenizer.process(batch)))
    finally:
        inbox.close(0)
        out.close(0)
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tokenizer_source, ipc_dir, parent_pid = argv[0], argv[1], int(argv[2])
    log_level = argv[3] if len(argv) > 3 else "info"
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    logging.basicConfig(level=log_level.upper(), format="[detokenizer %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    try:
        run(tokenizer_source, IpcPaths(ipc_dir), parent_pid)
    except SystemExit:
        pass
    except BaseException:
        logger.exception("the detokenizer process failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
