"""ZMQ plumbing shared by the three server processes: ipc paths and msgpack codecs.

Topology (every socket PUSH/PULL over ipc:// in a private temp dir; each PULL side binds its own path):

    tokenizer side --PUSH--> scheduler_in  --(Scheduler)--PUSH--> detokenizer_in --(Detokenizer)--PUSH--> tokenizer_in
    scheduler --PUSH--> tokenizer_in (handshake, stats and flush replies)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import msgspec

from radixrt.protocol.messages import (
    AbortReq,
    BatchStrOut,
    ControlOut,
    ControlReq,
    DetokenizerReady,
    GenerateReq,
    SchedulerReady,
)

SchedulerInbound = Union[GenerateReq, AbortReq, ControlReq]
TokenizerInbound = Union[BatchStrOut, SchedulerReady, DetokenizerReady, ControlOut]

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
