"""In-process backend: the DSL over a `radixrt.Engine` object (or anything with its methods).

It needs only the engine's public methods, never the runtime modules:
`generate(prompt=, sampling_params=, input_ids=, return_logprob=, logprob_start_len=,
top_logprobs_num=, stream=)`, `get_model_info()` and `flush_cache()`; with `use_sessions=True` also
`open_session()`, `close_session(id)` and `generate(session_params=)` (see `native`). The DSL calls `generate`
from many threads at once (run_batch, forks); the engine batches those concurrent calls.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

from ..chat_template import ChatTemplate
from .native import NativeBackend


class EngineBackend(NativeBackend):
    def __init__(self, engine: Any, chat_template: Optional[ChatTemplate] = None, use_sessions: bool = False) -> None:
        self.engine = engine
        super().__init__(chat_template=chat_template, use_sessions=use_sessions)

    def _fetch_model_info(self) -> Dict[str, Any]:
        getter = getattr(self.engine, "get_model_info", None)
        return dict(getter()) if getter is not None else {}

    def _open_session(self) -> str:
        return self.engine.open_session()

    def _close_session(self, session_id: str) -> None:
        self.engine.close_session(session_id)

    def _call(self, payload: Dict[str, Any], stream: bool):
        extra = {"session_params": payload["session_params"]} if "session_params" in payload else {}
        return self.engine.generate(
            **extra,
            prompt=payload.get("text"),
            sampling_params=payload.get("sampling_params"),
            input_ids=payload.get("input_ids"),
            return_logprob=bool(payload.get("return_logprob", False)),
            logprob_start_len=payload.get("logprob_start_len"),
            top_logprobs_num=payload.get("top_logprobs_num"),
            stream=stream,
        )

    def _request(self, payload: Dict[str, Any]) -> Any:
        return self._call(payload, stream=False)

    def _request_stream(self, payload: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        yield from self._call(payload, stream=True)

    def flush_cache(self) -> Any:
        flush = getattr(self.engine, "flush_cache", None)
        return flush() if flush is not None else None

    def shutdown(self) -> None:
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()
