"""ZMQ plumbing shared by the three server processes: ipc paths, msgpack codecs, process hygiene.

Topology (every socket PUSH/PULL over ipc:// in a private temp dir; each PULL side binds its own path):

    tokenizer side --PUSH--> scheduler_in  --(Scheduler)--PUSH--> detokenizer_in --(Detokenizer)--PUSH--> tokenizer_in
    scheduler --PUSH--> tokenizer_in (handshake, stats and flush replies)
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import msgspec

from radixrt.messages import (
    AbortReq,
    BatchStrOut,
    CloseSessionOut,
    CloseSessionReq,
    DetokenizerReady,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    OpenSessionOut,
    OpenSessionReq,
    SchedulerReady,
    StatsOut,
    StatsReq,
)

SchedulerInbound = Union[GenerateReq, AbortReq, FlushCacheReq, StatsReq, OpenSessionReq, CloseSessionReq]
TokenizerInbound = Union[BatchStrOut, SchedulerReady, DetokenizerReady, FlushCacheOut, StatsOut, OpenSessionOut,
                         CloseSessionOut]

ENCODER = msgspec.msgpack.Encoder()


def decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


@dataclass(frozen=True)
class IpcPaths:
    folder: str

    def _url(self, name: str) -> str:
        return f"ipc://{Path(self.folder) / name}"

    @property
    def scheduler_in(self) -> str:
        return self._url("scheduler_in")

    @property
    def detokenizer_in(self) -> str:
        return self._url("detokenizer_in")

    @property
    def tokenizer_in(self) -> str:
        return self._url("tokenizer_in")


def pin_helper_threads() -> None:
    """For the HTTP and detokenizer processes: one compute thread, no OpenMP spin-waiting.

    Must run before torch is imported (transformers' tokenizer classes import it when it is installed).
    """
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        os.environ[name] = "1"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def torch_single_thread() -> None:
    """If something imported torch anyway, keep it to one thread."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux), so no child outlives the server."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid
