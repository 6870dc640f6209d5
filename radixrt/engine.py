"""The in-process runtime, call-compatible with SGLang's offline Engine.

The scheduler runs in a background thread; calls from any number of threads (or coroutines) batch together.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from typing import Any, AsyncIterator, Iterator

from radixrt.detokenize import Detokenizer
from radixrt.messages import AbortReq, BatchTokenOut, GenerateReq, StrDelta
from radixrt.output import ResponseBuilder
from radixrt.sampling.params import SamplingParams
from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.engine")

_DONE = object()


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
        from radixrt.model_setup import LoadedModel
        from radixrt.scheduler.scheduler import Scheduler

        self.args = ServerArgs.from_kwargs(**kwargs)
        self.loaded = LoadedModel.load(self.args)
        self.model_path = self.loaded.model_path
        self.tokenizer = self.loaded.tokenizer
        self.runner = self.loaded.runner
        self.eos_ids = self.loaded.eos_ids
        self.grammars = self.loaded.grammars
        self.chat_template = self.loaded.chat_template
        self.scheduler = Scheduler(self.args, self.runner, self.tokenizer, self.eos_ids, self._on_tokens, self.grammars)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._counter = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="radixrt-scheduler", daemon=True)
        self._thread.start()

    # ----- the scheduler thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopped:
                if not self.scheduler.step():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except BaseException as exc:  # surface scheduler crashes to every caller instead of hanging them
            logger.exception("the scheduler thread died")
            self._error = exc
            with self._lock:
                waiters = list(self._waiters.values())
                self._waiters.clear()
            for waiter in waiters:
                waiter.put(exc)

    def _on_tokens(self, batch: BatchTokenOut) -> None:
        for out in self.detokenizer.process(batch).outputs:
            with self._lock:
                waiter = self._waiters.get(out.rid)
                if waiter is not None and out.delta.finish_reason is not None:
                    del self._waiters[out.rid]
            if waiter is not None:
                waiter.put(out)

    # ----- requests -----------------------------------------------------------------------------------

    def _prepare(
        self,
        prompt: str | list[str] | None,
        sampling_params: dict | list[dict] | None,
        input_ids: list[int] | list[list[int]] | None,
    ) -> tuple[list[list[int]], list[SamplingParams], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            batched = isinstance(prompt, list)
            texts = prompt if batched else [prompt]
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            ids = [self.tokenizer.encode(t) for t in texts]
        else:
            batched = bool(input_ids) and isinstance(input_ids[0], list)
            ids = [list(x) for x in input_ids] if batched else [list(input_ids)]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids)
        for one_ids, one_params in zip(ids, params):
            self.scheduler.validate(one_ids, one_params)
            if self.grammars is not None:
                for kind, spec in self._grammar_of(one_params):
                    self.grammars.validate(kind, spec)
        return ids, params, batched

    @staticmethod
    def _grammar_of(params: SamplingParams) -> list[tuple[str, str]]:
        if params.regex is not None:
            return [("regex", params.regex)]
        if params.json_schema is not None:
            return [("json_schema", params.json_schema)]
        if params.choices is not None:
            import json

            return [("choices", json.dumps(params.choices))]
        return []

    def _submit(
        self,
        ids: list[int],
        params: SamplingParams,
        return_logprob: bool,
        logprob_start_len: int | None,
        top_logprobs_num: int | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> tuple[str, _Waiter]:
        if self._error is not None:
            raise RuntimeError(f"the scheduler thread died: {self._error!r}")
        if self._stopped:
            raise RuntimeError("the engine is shut down")
        rid = f"{uuid.uuid4().hex[:12]}-{next(self._counter)}"
        top = top_logprobs_num or 0
        waiter = _Waiter(ResponseBuilder(rid, return_logprob, top), loop)
        grammar = self._grammar_of(params)
        msg = GenerateReq(
            rid=rid,
            input_ids=ids,
            params=params,
            return_logprob=return_logprob,
            logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
            top_logprobs_num=top,
            grammar=grammar[0] if grammar else None,
        )
        with self._lock:
            self._waiters[rid] = waiter
        self.scheduler.submit(msg)
        self._wake.set()
        return rid, waiter

    def _expand(self, ids, params, return_logprob, logprob_start_len, top_logprobs_num, loop=None):
        """One submission per sample: n > 1 becomes n requests that share the prompt through the cache."""
        out = []
        for one_ids, one_params in zip(ids, params):
            for i in range(one_params.n):
                p = one_params
                if p.n > 1:
                    seed = None if p.seed is None else p.seed + i
                    p = SamplingParams.from_dict({**_as_dict(p), "n": 1, "seed": seed})
                out.append(self._submit(one_ids, p, return_logprob, logprob_start_len, top_logprobs_num, loop))
        return out

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        ids, params, batched = self._prepare(prompt, sampling_params, input_ids)
        submitted = self._expand(ids, params, return_logprob, logprob_start_len, top_logprobs_num)
        if stream:
            if len(submitted) != 1:
                raise ValueError("stream=True takes one prompt with n=1")
            return self._stream(*submitted[0])
        results = [self._collect(rid, waiter) for rid, waiter in submitted]
        return results if batched or len(results) > 1 else results[0]

    def _next(self, waiter: _Waiter, rid: str) -> StrDelta:
        while True:
            try:
                item = waiter.queue.get(timeout=0.5)
            except queue.Empty:
                if self._error is not None:
                    raise RuntimeError(f"the scheduler thread died: {self._error!r}") from self._error
                continue
            if isinstance(item, BaseException):
                raise RuntimeError(f"the scheduler thread died: {item!r}") from item
            return item

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
        result = builder.to_dict()
        reason = result["meta_info"]["finish_reason"]
        if reason and reason.get("type") == "abort" and reason.get("message") not in (None, "aborted"):
            raise ValueError(reason["message"])
        return result

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        ids, params, batched = self._prepare(prompt, sampling_params, input_ids)
        submitted = self._expand(ids, params, return_logprob, logprob_start_len, top_logprobs_num, loop)
        if stream:
            if len(submitted) != 1:
                raise ValueError("stream=True takes one prompt with n=1")
            return self._astream(*submitted[0])
        results = [await self._acollect(rid, waiter) for rid, waiter in submitted]
        return results if batched or len(results) > 1 else results[0]

    async def _anext(self, waiter: _Waiter) -> StrDelta:
        item = await waiter.queue.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"the scheduler thread died: {item!r}") from item
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
        """Run ``fn`` on the scheduler thread between steps and return its result."""
        from radixrt.scheduler.scheduler import ControlCall

        call = ControlCall(fn)
        self.scheduler.submit(call)
        self._wake.set()
        call.done.wait()
        return call.result

    def get_model_info(self) -> dict[str, Any]:
        return self.loaded.model_info()

    def get_stats(self) -> dict[str, Any]:
        import msgspec

        return msgspec.structs.asdict(self._call(self.scheduler.stats))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _as_dict(params: SamplingParams) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(params)
