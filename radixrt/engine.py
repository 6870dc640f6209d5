"""The offline runtime, call-compatible with SGLang's offline Engine.

Calls from any number of threads (or coroutines) batch together. Requests go through the one client of the
scheduler (``radixrt.client.SchedulerClient``), as the server's do. Where the scheduler runs
(``engine_scheduler``):

- ``thread`` (the default on a CPU): on a background thread of this process, which also loads the model; the
  client's transport is the scheduler's inbox, and token ids become text on a second thread
  (``radixrt-detokenizer``), in the order the scheduler emitted them. ``scheduler``, ``runner``, ``loaded`` and
  ``grammars`` are the live objects (benchmarks and tests read them).
- ``process`` (the default on CUDA, as SGLang's and vLLM's engines run theirs): in a process of its own, with the
  detokenizer in another, started as ``radixrt serve`` starts them (``radixrt.server.detached``), so no thread of
  the caller's shares the scheduler's GIL. Reading those four attributes is an AttributeError that says how to
  get them; a helper that dies is ``EngineDead``.

A request the runtime cannot serve raises ``ValueError`` (``RequestError``) before it is queued; a request that
failed inside the runtime (its batch's forward failed) raises ``RuntimeError`` (``RequestFailed``) while the
engine keeps serving. Only a model that can no longer run stops the scheduler thread: then every call raises
``EngineDead`` at once, with the cause. Under tensor parallelism (``tp_size > 1``) this process is rank 0 and
spawns the other ranks; a rank that dies stops the scheduler thread the same way (``EngineDead``, the cause a
``RankFailure``), and ``shutdown`` stops the follower processes. Engines still running when the interpreter
exits are shut down first (as SGLang's Engine does), so a script that never calls ``shutdown()`` ends cleanly.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from radixrt import env
from radixrt.client import Handle, LoopWaker, SchedulerClient, ThreadWaker
from radixrt.detokenize import Detokenizer
from radixrt.engine_weights import WeightCalls
from radixrt.protocol.errors import RuntimeDown
from radixrt.protocol.messages import (
    BatchStrOut,
    BatchTokenOut,
    CloseSessionReq,
    Control,
    ControlOut,
    FlushCacheReq,
    LoadLoraReq,
    OpenSessionReq,
    StartProfileReq,
    StatsReq,
    StopProfileReq,
    UnloadLoraReq,
)
from radixrt.protocol.request import GenerateInput, Prepared
from radixrt.rerank import RerankCall, ranked, reranker_of
from radixrt.scoring import ScoreCall, label_scores, score_input
from radixrt.server_args import ENGINE_SCHEDULERS, ServerArgs

if TYPE_CHECKING:
    from radixrt.server.detached import DetachedRuntime

logger = logging.getLogger("radixrt.engine")

_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
POLL_SECONDS = 0.5  # how often a waiting caller checks that the scheduler is still alive
IN_PROCESS_ONLY = ("loaded", "scheduler", "runner", "grammars")  # a threaded Engine's live objects


def runs_detached(args: ServerArgs) -> bool:
    """Whether an Engine with these options runs its scheduler in a process of its own: as asked, else as
    ``RADIXRT_ENGINE_SCHEDULER`` says, else on CUDA."""
    choice = args.engine_scheduler
    if choice == "auto":
        choice = env.get("RADIXRT_ENGINE_SCHEDULER") or "auto"
        if choice not in ENGINE_SCHEDULERS:
            raise ValueError(f"RADIXRT_ENGINE_SCHEDULER={choice!r}; choose one of {', '.join(ENGINE_SCHEDULERS)}")
    return choice == "process" or (choice == "auto" and args.device == "cuda")


class EngineDead(RuntimeDown):
    """The scheduler thread has stopped (the model cannot run, or the engine was shut down)."""


class Engine(WeightCalls):
    def __init__(self, **kwargs: Any) -> None:
        self.args = ServerArgs.from_kwargs(**kwargs)
        if self.args.dp_size != 1:
            raise ValueError("an Engine is one data-parallel replica; dp_size > 1 is `radixrt serve --dp-size N` "
                             "(or sgl.Runtime(dp_size=N))")
        self._outputs: queue.SimpleQueue[BatchTokenOut | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._detached: DetachedRuntime | None = None
        if runs_detached(self.args):
            self._start_detached()
        else:
            self._start_thread()
        _LIVE_ENGINES.add(self)

    def _start_thread(self) -> None:
        """The scheduler on a thread of this process (it loads the model there), the detokenizer on another."""
        built: concurrent.futures.Future = concurrent.futures.Future()
        go = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(built, go), name="radixrt-scheduler", daemon=True)
        self._thread.start()
        self.loaded, self.scheduler = built.result()  # the model could not load: its error, raised here
        try:
            self.model_path = self.loaded.model_path
            self.tokenizer = self.loaded.tokenizer
            self.runner = self.loaded.runner
            self.eos_ids = self.loaded.eos_ids
            self.grammars = self.loaded.grammars
            self.chat_template = self.loaded.chat_template
            self.client = SchedulerClient(self._send, encode=self.tokenizer.encode,
                                          limits=lambda: self.scheduler.limits)
            self.detokenizer = Detokenizer(self.tokenizer)
            self._detokenizer_thread = threading.Thread(target=self._detokenize_loop, name="radixrt-detokenizer",
                                                        daemon=True)
            self._detokenizer_thread.start()
        except BaseException:
            self._stopped = True  # the scheduler thread closes the model on its way out
            go.set()
            self._thread.join()
            raise
        go.set()

    def _start_detached(self) -> None:
        """The scheduler and the detokenizer in processes of their own (radixrt.server.detached)."""
        from radixrt.model.weights import resolve_model_path
        from radixrt.server.detached import DetachedRuntime
        from radixrt.tokenizer import load_tokenizer

        self.model_path = resolve_model_path(self.args.model)  # fetched or converted once, before the helpers
        tokenizer_path = str(self.args.tokenizer_path or self.model_path)
        self.client = SchedulerClient(self._send, encode=lambda text: self.tokenizer.encode(text),
                                      limits=lambda: self._detached.limits)
        self._detached = DetachedRuntime(self.args, lambda: load_tokenizer(tokenizer_path, self.args.chat_template),
                                         tokenizer_path, self._deliver, self.client.fail_all)
        self.tokenizer = self._detached.tokenizer  # loaded while the scheduler process loaded the model
        info = self._detached.ready.model_info
        self.eos_ids = set(info["eos_token_ids"])
        self.chat_template = info["chat_template"]

    def __getattr__(self, name: str) -> Any:
        if name in IN_PROCESS_ONLY and self.__dict__.get("_detached") is not None:
            raise AttributeError(f"Engine.{name} lives in the scheduler's own process (engine_scheduler='process', "
                                 "the default on CUDA); pass engine_scheduler='thread' or set "
                                 "RADIXRT_ENGINE_SCHEDULER=thread to have it here")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _deliver(self, msg: object) -> None:
        """What the detached runtime sends back (its receiver thread): text deltas and control replies."""
        if isinstance(msg, ControlOut):
            self.client.on_reply(msg)
        elif isinstance(msg, BatchStrOut):
            self.client.on_outputs(msg)

    def _run(self, built: concurrent.futures.Future, go: threading.Event) -> None:
        """The scheduler thread. The model is loaded here, on the thread that runs every forward: OpenMP gives
        each thread that starts parallel work a pool of its own, and where the pools' threads outnumber the
        CPUs (a pool made while loading on the caller's thread, another for the forwards) libgomp lets idle
        workers sleep at once, so every kernel paid a wake-up: a batch-1 decode step of the default model took
        19-20 ms instead of 12-13 on 2 vCPUs."""
        from radixrt.loaded_model import LoadedModel
        from radixrt.scheduler.scheduler import Scheduler

        try:
            loaded = LoadedModel.load(self.args)
            try:
                scheduler = Scheduler(self.args, loaded.runner, loaded.tokenizer, loaded.eos_ids, self._outbox,
                                      loaded.grammars)
            except BaseException:
                loaded.close()
                raise
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result((loaded, scheduler))
        go.wait()
        self._loop()

    # ----- the transport: the scheduler's inbox in, its outbox out --------------------------------------

    def _send(self, msg: object) -> None:
        if self._detached is not None:
            self._detached.send(msg)
            return
        self.scheduler.submit(msg)
        self._wake.set()

    def _outbox(self, msg: BatchTokenOut | ControlOut) -> None:
        """The scheduler's sink (its thread): token deltas to the detokenizer thread, control replies back."""
        if isinstance(msg, ControlOut):
            self.client.on_reply(msg)
        else:
            self._outputs.put(msg)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self.loaded.check_ranks()
                if not self.scheduler.step():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
            self.scheduler.close()
            self.loaded.close()  # here: the follower ranks take their stop in step order
        except BaseException as exc:  # the model cannot run any more: fail every caller instead of hanging them
            logger.exception("the scheduler thread died")
            self._error = exc
            self.client.fail_all(f"the scheduler thread died: {exc!r}")
            if self.loaded.world is not None:
                self.loaded.world.abort()

    def _detokenize_loop(self) -> None:
        while (batch := self._outputs.get()) is not None:
            try:
                self.client.on_outputs(self.detokenizer.process(batch))
            except Exception:  # a bug here must not strand the callers of every later batch
                logger.exception("delivering a batch of outputs failed")

    # ----- requests -----------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDead(f"the scheduler thread died: {self._error!r}") from self._error
        if self._detached is not None:
            problem = self._detached.problem()
            if problem is not None:
                raise EngineDead(f"the engine's runtime stopped: {problem}")
        if self._stopped or (self._detached is None and not self._thread.is_alive()):
            raise EngineDead("the engine is shut down")

    def _submit(self, req: GenerateInput, waker: ThreadWaker | LoopWaker) -> tuple[Prepared, list[Handle]]:
        self._check_alive()
        prepared = self.client.prepare(req)
        try:
            return prepared, self.client.submit(prepared, waker)
        except RuntimeDown as exc:
            raise EngineDead(str(exc)) from exc

    def _result(self, handle: Handle) -> dict:
        try:
            handle.raise_for_failure()
        except RuntimeDown as exc:
            raise EngineDead(str(exc)) from exc
        return self.client.snapshot(handle)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        priority: int | None = None,
        session_params: dict | None = None,
        rid: str | list[str] | None = None,
        lora_path: str | list[str | None] | None = None,
        token_ids_logprob: list[int] | list[list[int] | None] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang's ``Engine.generate``; ``lora_path`` names a loaded LoRA adapter (or one per prompt);
        ``token_ids_logprob`` (with ``return_logprob``): these ids' logprobs at every returned position
        (``meta_info["output_token_ids_logprobs"]``, and ``input_token_ids_logprobs`` from ``logprob_start_len``);
        with ``max_new_tokens`` 0, at the position after the prompt."""
        req = GenerateInput.of_call(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                    top_logprobs_num, stream, priority, session_params, rid, lora_path,
                                    token_ids_logprob)
        waker = ThreadWaker()
        prepared, handles = self._submit(req, waker)
        if stream:
            return self._stream(handles[0], waker)
        results = self._wait(handles, waker)
        return results if prepared.batched or len(results) > 1 else results[0]

    def encode(self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
               rid: str | list[str] | None = None, dimensions: int | None = None,
               lora_path: str | list[str | None] | None = None) -> dict | list[dict]:
        """SGLang's ``Engine.encode``: each prompt's embedding (pooled as the model says, by default the last
        token's final hidden state at unit length; radixrt.scheduler.embedding) as ``{"embedding": [...],
        "meta_info": {...}}``, a list for a list of prompts; ``dimensions`` cuts it (a Matryoshka model). The
        prompts go through the request path and the scheduler as prefill-only requests."""
        waker = ThreadWaker()
        call = GenerateInput(text=prompt, input_ids=input_ids, rid=rid, embed=True, dimensions=dimensions,
                             lora_path=lora_path)
        prepared, handles = self._submit(call, waker)
        results = self._wait(handles, waker)
        return results if prepared.batched else results[0]

    def score(self, query: str | list[int], items: str | list[str] | list[list[int]], label_token_ids: list[int],
              apply_softmax: bool = False, item_first: bool = False,
              lora_path: str | None = None) -> list[list[float]]:
        """SGLang's ``Engine.score``: for each item, the probabilities of ``label_token_ids`` as the next token after
        the query then the item (``item_first``: the item then the query), in the labels' order; ``apply_softmax``
        renormalizes them over the labels. Query and items are both text (joined, then tokenized) or both token
        ids. Each item is a prompt-only request (radixrt.scoring); the query is a prefix the cache shares."""
        call = ScoreCall(query, items, label_token_ids, apply_softmax, item_first, lora_path)
        waker = ThreadWaker()
        _, handles = self._submit(score_input(call), waker)
        return [label_scores(r, label_token_ids, apply_softmax) for r in self._wait(handles, waker)]

    def rerank(self, query: str, documents: list[str], instruct: str | None = None, top_n: int | None = None,
               return_documents: bool = True, lora_path: str | None = None) -> list[dict[str, Any]]:
        """SGLang's /v1/rerank as a call: every document's relevance to ``query`` in [0, 1] as ``{"score",
        "document", "index", "meta_info"}``, best first, the first ``top_n``. The served model must rerank: a
        cross-encoder (a one-label classifier) or a yes/no reranker with its template (radixrt.rerank)."""
        call = RerankCall(query, documents, instruct, top_n, return_documents)
        reranker = reranker_of(self.get_model_info(), self.tokenizer)
        waker = ThreadWaker()
        _, handles = self._submit(reranker.request(self.tokenizer, call, lora_path), waker)
        results = self._wait(handles, waker)
        return ranked(call, [reranker.score(r) for r in results], [r["meta_info"] for r in results])

    def _wait(self, handles: list[Handle], waker: ThreadWaker) -> list[dict]:
        """Every handle's result once all have finished (an interrupted wait aborts the unfinished ones)."""
        try:
            while not all(h.finished for h in handles):
                if not waker.wait(POLL_SECONDS):
                    self._check_alive()
        except BaseException:
            self.client.abort_unfinished(handles)
            raise
        return [self._result(h) for h in handles]

    def _changed(self, handle: Handle, seen: tuple | None) -> tuple[dict | None, tuple]:
        """(the response if it changed since ``seen``, else None; what was seen now): a stream's next chunk."""
        progress = self.client.progress(handle)
        return (self._result(handle) if progress != seen else None), progress

    def _stream(self, handle: Handle, waker: ThreadWaker) -> Iterator[dict]:
        try:
            seen = None
            while True:
                chunk, seen = self._changed(handle, seen)
                if chunk is not None:
                    yield chunk
                if handle.finished:
                    return
                if not waker.wait(POLL_SECONDS):
                    self._check_alive()
        finally:
            if not handle.finished:
                self.client.abort(handle.rid)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        priority: int | None = None,
        session_params: dict | None = None,
        rid: str | list[str] | None = None,
        lora_path: str | list[str | None] | None = None,
        token_ids_logprob: list[int] | list[list[int] | None] | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        req = GenerateInput.of_call(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                    top_logprobs_num, stream, priority, session_params, rid, lora_path,
                                    token_ids_logprob)
        waker = LoopWaker()
        prepared, handles = self._submit(req, waker)
        if stream:
            return self._astream(handles[0], waker)
        try:
            while not all(h.finished for h in handles):
                await self._await_wake(waker)
        except BaseException:
            self.client.abort_unfinished(handles)
            raise
        results = [self._result(h) for h in handles]
        return results if prepared.batched or len(results) > 1 else results[0]

    async def _await_wake(self, waker: LoopWaker) -> None:
        try:
            await asyncio.wait_for(waker.wait(), POLL_SECONDS)
        except asyncio.TimeoutError:
            self._check_alive()

    async def _astream(self, handle: Handle, waker: LoopWaker) -> AsyncIterator[dict]:
        try:
            seen = None
            while True:
                chunk, seen = self._changed(handle, seen)
                if chunk is not None:
                    yield chunk
                if handle.finished:
                    return
                await self._await_wake(waker)
        finally:
            if not handle.finished:
                self.client.abort(handle.rid)

    # ----- control ------------------------------------------------------------------------------------

    def abort(self, rid: str) -> None:
        self.client.abort(rid)

    def _call(self, body: Control):
        """A control call: run on the scheduler thread between steps; its reply's body (or its error)."""
        self._check_alive()
        future = self.client.call(body)
        while True:
            try:
                return future.result(timeout=POLL_SECONDS)
            except concurrent.futures.TimeoutError:
                self._check_alive()
            except RuntimeDown as exc:
                raise EngineDead(str(exc)) from exc

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are in flight."""
        if self._detached is None and not self.scheduler.idle:  # detached: the scheduler itself refuses
            return False
        return self._call(FlushCacheReq()).ok

    def open_session(self, capacity_of_str_len: int | None = None, session_id: str | None = None) -> str:
        """Open a session (SGLang's ``open_session``): pass ``session_params={"id": ...}`` with its requests and
        each one's context stays pinned in the prefix cache for the next turn. Returns its id (``session_id`` if
        given); ValueError for an id already open or a bad capacity."""
        return self._call(OpenSessionReq(capacity_of_str_len, session_id)).session_id

    def close_session(self, session_id: str) -> None:
        """Close a session and release its pages to the cache; closing an unknown session does nothing."""
        self._call(CloseSessionReq(session_id))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, str]:
        """Load a LoRA adapter (a PEFT folder or a hub id) under ``lora_name``, for requests that name it by
        ``lora_path=``; needs ``enable_lora=True``. Returns every loaded adapter's name -> path; ValueError for a
        name in use, an adapter that cannot be served, or one past ``max_loaded_loras``. (``pinned``, SGLang's
        keep-in-GPU-memory hint, changes nothing: every loaded adapter stays in memory.) A hub id is fetched here,
        on the caller's thread, so the download never holds up the requests being served."""
        folder = None
        if self.args.enable_lora:
            from radixrt.model.weights import resolve_adapter_path

            folder = str(resolve_adapter_path(lora_path))
        return self._call(LoadLoraReq(lora_name, lora_path, folder)).loaded

    def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Unload an adapter; ValueError while requests use it or if none is loaded under that name."""
        return self._call(UnloadLoraReq(lora_name)).loaded

    def start_profile(self) -> None:
        """Start torch.profiler on the scheduler thread (see radixrt.scheduler.profiler)."""
        self._call(StartProfileReq())

    def stop_profile(self, trace_dir: str | None = None) -> dict[str, dict[str, float]]:
        """Stop it: each operator's self CPU seconds and calls; a Chrome trace in ``trace_dir`` if given."""
        return self._call(StopProfileReq(trace_dir)).operators

    def get_model_info(self) -> dict[str, Any]:
        info = self._detached.ready.model_info if self._detached is not None else self.loaded.model_info()
        return {**info, **self.client.weights_info}

    def get_stats(self) -> dict[str, Any]:
        import msgspec

        return msgspec.structs.asdict(self._call(StatsReq()).stats)

    def shutdown(self) -> None:
        """Stop the scheduler (after its current step); calls still waiting raise EngineDead."""
        self._stopped = True
        if self._detached is not None:
            self._detached.close()
            _LIVE_ENGINES.discard(self)
            self.client.fail_all("the engine is shut down")
            return
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loaded.close()  # a no-op where the thread already did it
        self._outputs.put(None)
        if threading.current_thread() is not self._detokenizer_thread:
            self._detokenizer_thread.join(timeout=30)
        _LIVE_ENGINES.discard(self)
        self.client.fail_all("the engine is shut down")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


@atexit.register
def _shutdown_live_engines() -> None:
    """A script that ends without shutdown(): stop the scheduler threads before the interpreter tears down."""
    for engine in list(_LIVE_ENGINES):
        engine.shutdown()

