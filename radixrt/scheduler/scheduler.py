"""The scheduler: intake, then one step at a time: admit, plan, reserve pages, forward, process output, emit.

Its parts, each with its own contract: ``admission`` (the waiting queue, policy order, page budget),
``memory`` (the only code that changes a request's pages), ``batch`` (the plan and its ForwardBatch),
``output`` (sampling, finish checks, jump-forward, deltas; ``logits`` turns rows into tokens and logprobs),
``sessions`` (open sessions, ``session_params``, each session's pin on its latest context in the cache),
``overlap`` (decode step N+1 launched before step N's tokens are read back; on CUDA by default), ``speculation``
(draft tokens verified in the same forward; ``drafts`` finds them), ``control`` (the answers to control calls:
stats, flush, sessions, profiling), ``weights`` (pauses and updates of weights: the gate that holds new requests).
This module takes messages in (``submit``, drained at the start of each step: requests, aborts and control
calls, whose replies go to the sink like the token deltas), runs the step loop, moves requests between the
queues and keeps the counters behind ``stats`` (``reporting`` assembles them and the log line).

Page ownership follows the radix cache's rule: a page's single reference belongs to the tree or to the one
request that allocated it. A running request reads tree pages under a lock on its deepest cached node.

Faults stay with the request they belong to. A request that cannot be served is refused when it arrives;
an error while handling one request's output (logprobs, penalties, grammar, stop strings, sampling) finishes
that request with a 500-coded abort and frees its pages; an error in a batch's forward does the same for the
batch's requests. Only a forward that keeps failing (MAX_FORWARD_FAILURES batches in a row: the model can no
longer run) or a broken page invariant escapes ``step()``, and then the caller must stop serving.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from radixrt.detokenize import TextStream
from radixrt.memory.radix_cache import RadixCache
from radixrt.metrics import STEP_BUCKETS, Histogram
from radixrt.model.runner import ModelRunner
from radixrt.protocol.errors import RequestError, status_of
from radixrt.protocol.limits import ModelLimits
from radixrt.protocol.messages import (
    AbortReq,
    BatchTokenOut,
    ControlOut,
    ControlReq,
    FinishReason,
    GenerateReq,
    InitWeightGroupReq,
    ReqDelta,
    SchedulerStats,
)
from radixrt.protocol.validation import validate_kind, validate_request
from radixrt.scheduler.admission import Admission
from radixrt.scheduler import lora
from radixrt.scheduler.batch import Plan, build_forward_batch, plan_batch
from radixrt.scheduler.control import answer
from radixrt.scheduler.memory import Memory
from radixrt.scheduler.output import OutputProcessor
from radixrt.scheduler.overlap import (Launched, continuation, continuation_batch, continued_sampling, launch,
                                      overlappable)
from radixrt.scheduler.policy import POLICIES
from radixrt.scheduler.profiler import StepProfiler
from radixrt.scheduler.reporting import collect_stats, log_progress
from radixrt.scheduler.request import Req
from radixrt.scheduler.sessions import Sessions
from radixrt.scheduler.speculation import Speculator
from radixrt.scheduler.weight_groups import WeightGroups, begin_join
from radixrt.scheduler.weights import Gate, begin_update, update_due, waits_for_requests
from radixrt.server_args import ServerArgs

if TYPE_CHECKING:
    from radixrt.constrained.grammar_backend import GrammarBackend

logger = logging.getLogger("radixrt.scheduler")
# Forward failures in a row after which the model is taken to be unable to run (the step raises ModelFailure).
MAX_FORWARD_FAILURES = 3


class ModelFailure(RuntimeError):
    """The model's forward keeps failing: the runtime cannot serve any request."""


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        tokenizer,
        eos_ids: set[int],
        sink: Callable[[BatchTokenOut | ControlOut], None],
        grammars: GrammarBackend | None = None,
    ) -> None:
        if args.schedule_policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {args.schedule_policy!r}; choose one of {POLICIES}")
        if args.chunked_prefill_size == -1:  # SGLang's "no chunking": a whole prompt in one step
            args = args.replace(chunked_prefill_size=runner.context_length)
        if args.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1, or -1 (no chunking)")
        if args.priority_scheduling_preemption_threshold < 0:
            raise ValueError("priority_scheduling_preemption_threshold must be >= 0")
        self.args = args
        self.runner = runner
        self.pool = runner.pool
        self.page_size = runner.page_size
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.vocab_size = runner.config.vocab_size
        self.context_length = runner.context_length
        self.sink = sink
        self.grammars = grammars
        self.cache = RadixCache(
            self.pool, disabled=args.disable_radix_cache, partial_page_reuse=not args.disable_partial_page_reuse
        )
        self.memory = Memory(self.pool, self.cache, self.page_size, args.schedule_low_priority_values_first)
        self.admission = Admission(args, self.cache, self.memory, self.page_size)
        self.sessions = Sessions(args, self.cache, self.page_size, getattr(tokenizer, "bos_token_id", None))
        self.memory.unpin = self.sessions.unpin_lru
        self.output = OutputProcessor(tokenizer, self.eos_ids, self.vocab_size, self.context_length, self.page_size,
                                      grammars, self.memory, sink)
        self.speculator: Speculator | None = None
        if args.speculative_algorithm is not None:
            self.speculator = Speculator(args, self.cache, self.memory, self.context_length, runner.long_rope_from)
            self.output.speculator = self.speculator
        self.inbox: deque[GenerateReq | AbortReq | ControlReq] = deque()
        self.gate = Gate(args.weight_version)  # pauses and updates of weights (scheduler/weights.py)
        self.weight_groups = WeightGroups()  # trainers' process groups (scheduler/weight_groups.py)
        self.output.weight_version = args.weight_version
        self.running: list[Req] = []
        overlap_here = args.enable_overlap_schedule or runner.device.type == "cuda"
        # A verify step's tokens decide the next step's input: speculation steps one at a time.
        self.overlap = (overlap_here and not args.disable_overlap_schedule and self.speculator is None
                        and getattr(runner, "world", None) is None)
        self.launched: Launched | None = None  # the decode step in flight under overlap scheduling
        self.launched_steps = 0  # decode steps launched ahead of their tokens (overlap scheduling)
        self.steps = 0
        self.last_step_seconds = 0.0
        self.forward_seconds = 0.0
        self.decode_seconds = 0.0  # in steps without prefill chunks (decode and verify steps)
        self.decode_tokens = 0  # output tokens those steps gave
        self.decode_steps = 0  # those steps
        self.decode_requests = 0  # requests in those steps, summed over them (/ decode_steps: the mean batch)
        self.forward_failures = 0  # in a row
        self.step_latency = Histogram(STEP_BUCKETS)  # of the steps that did something
        self.profiler = StepProfiler()
        self._last_log = time.monotonic()
        self._step_tokens = 0
        # Requests without a seed of their own draw one here in arrival order: the same requests in the same
        # order sample the same tokens run after run.
        self._seeds = random.Random(args.random_seed)

    @property
    def waiting(self) -> list[Req]:
        return self.admission.waiting

    @property
    def num_retractions(self) -> int:
        return self.admission.num_retractions

    @property
    def jump_forwards(self) -> int:
        return self.output.jump_forwards

    # ----- intake -------------------------------------------------------------------------------------

    @property
    def limits(self) -> ModelLimits:
        runner = self.runner
        return ModelLimits(vocab_size=self.vocab_size, context_length=self.context_length,
                           page_size=self.page_size, num_pages=self.pool.num_pages,
                           generates=not runner.embedding_only, embedding_size=runner.config.hidden_size,
                           matryoshka=runner.matryoshka)

    def validate(self, msg: GenerateReq) -> None:
        """Raise RequestError for a request that can never be served. Safe to call from any thread."""
        validate_kind(msg.embed, msg.dimensions, self.limits)
        validate_request(msg.input_ids, msg.params, self.limits, return_logprob=msg.return_logprob,
                         logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                         token_ids_logprob=msg.token_ids_logprob)

    def submit(self, msg: GenerateReq | AbortReq | ControlReq) -> None:
        """Thread-safe: messages are taken in at the start of the next step."""
        self.inbox.append(msg)

    def _take_inbox(self) -> None:
        while self.inbox:
            msg = self.inbox.popleft()
            if isinstance(msg, GenerateReq):
                if self.gate.closed:
                    self.gate.held.append(msg)
                else:
                    self._add_request(msg)
            elif isinstance(msg, AbortReq):
                self._abort(msg.rid)
            elif isinstance(msg, ControlReq):
                if waits_for_requests(msg) and self.gate.pending is None:
                    begin_update(self, msg)  # answered once its turn comes (_step)
                elif isinstance(msg.body, InitWeightGroupReq):
                    try:
                        begin_join(self, msg)  # answered once every rank has joined (_step)
                    except RequestError as exc:
                        self.sink(ControlOut(msg.id, error=str(exc), status_code=status_of(exc)))
                else:
                    self.sink(answer(self, msg))

    def _add_request(self, msg: GenerateReq) -> None:
        seed = self._seeds.getrandbits(63)
        try:
            if msg.session is not None:
                msg = self.sessions.resolve(msg)  # an unknown session or rid: this request's 400
            self.validate(msg)
            req = Req.from_message(msg, seed, lora.adapter_uid(self.runner, msg.lora_path),
                                   self.runner.long_rope_from, self.runner.pooling)
        except RequestError as exc:
            self.refuse(msg, FinishReason.error(str(exc), status_of(exc)))
            return
        except Exception as exc:  # this request's error only
            logger.exception("could not take in request %s", msg.rid)
            self.refuse(msg, FinishReason.error(f"invalid request: {exc!r}", 400))
            return
        req.arrival = time.monotonic()
        if msg.session is not None:
            self.sessions.admitted(req.rid, msg.session.id)
        if msg.grammar is not None and self.grammars is None:
            self.sessions.ended(req.rid)
            req.finish_reason = FinishReason.error("constrained decoding is not available", 400)
            self.output.emit([req])
            return
        try:
            if req.params.stop or req.params.stop_regex:
                req.stop_text = TextStream(self.tokenizer, req.params.stop, req.params.skip_special_tokens,
                                           stop_regex=req.params.stop_regex)
            if msg.grammar is not None:
                req.grammar_future = self.grammars.compile_async(*msg.grammar)
        except Exception as exc:
            self.sessions.ended(req.rid)
            self.output.finish_with_error(req, exc, "preparing the request")
            self.output.emit([req])
            return
        self.waiting.append(req)

    def refuse(self, msg: GenerateReq, reason: FinishReason) -> None:
        self.sink(BatchTokenOut([ReqDelta(rid=msg.rid, new_ids=[], finish_reason=reason,
                                          prompt_tokens=len(msg.input_ids),
                                          weight_version=self.gate.weight_version)]))

    def _abort(self, rid: str) -> None:
        held = self.gate.drop_held(rid)
        if held is not None:
            self.refuse(held, FinishReason.aborted())
            return
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self.memory.release(req)
                    self.sessions.ended(req.rid)
                    req.finish_reason = FinishReason.aborted()
                    self.output.emit([req])
                    return

    def close(self) -> None:
        """The runtime stops: leave the trainers' process groups (scheduler thread, after the last step)."""
        self.weight_groups.close()

    def flush_cache(self) -> bool:
        """Drop every cached page; only possible while nothing runs. Open sessions lose their pins (they stay
        open; their next turn is computed again)."""
        if self.running or self.waiting or self.launched:
            return False
        self.drop_cache()
        return True

    def drop_cache(self) -> None:
        """Release the sessions' pins and free every cached page (no running request may hold tree pages)."""
        self.sessions.unpin_all()
        self.cache.reset()

    def open_session(self, capacity_of_str_len: int | None = None, session_id: str | None = None) -> str:
        """Open a session (scheduler thread); RequestError for a duplicate id or a bad value."""
        return self.sessions.open(capacity_of_str_len, session_id)

    def close_session(self, session_id: str) -> bool:
        """Close a session and release its pin (scheduler thread); False if it was not open."""
        return self.sessions.close(session_id)

    def load_lora(self, name: str, path: str, folder: str | None = None) -> dict[str, str]:
        return lora.load(self.runner, name, path, self.args.max_loaded_loras, folder)

    def unload_lora(self, name: str) -> dict[str, str]:
        return lora.unload(self.runner, name, self.waiting + self.running)

    @property
    def idle(self) -> bool:
        """Nothing to do until a message arrives (paused: nothing can progress before one does)."""
        if self.inbox or self.launched or self.weight_groups.joining:
            return False
        gate = self.gate
        return gate.stopped or not (self.waiting or self.running or gate.pending or gate.held)

    # ----- one step -----------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one scheduling step; returns False when there was nothing to do."""
        started = time.perf_counter()
        busy = self._step(started)
        if busy:
            self.step_latency.observe(time.perf_counter() - started)
            self.profiler.step()
        return busy

    def _restart_long_rope(self) -> None:
        """LongRoPE: a running request whose sequence outgrew the original context is computed again from its first
        token with the long frequencies, as transformers' Phi-3 generation recomputes it then; its short-rotated
        pages stay cached for other requests rotated short."""
        for req in [r for r in self.running if r.outgrows_short_rope(self.runner.long_rope_from)]:
            self.memory.release(req)
            req.switch_to_long_rope()
            self.running.remove(req)
            self.admission.take_back(req, "long_rope")

    def _step(self, started: float) -> bool:
        if self.launched is not None:
            if self._continue_launched(started):
                return True
            self._settle()
            return True
        had_messages = bool(self.inbox)
        self._take_inbox()
        self.weight_groups.settle(self.sink)
        update = update_due(self)
        if update is not None:
            self.sink(answer(self, update))
            return True
        if self.gate.stopped:
            return had_messages
        for req in self.admission.drop_failed_grammars():
            self.sessions.ended(req.rid)
            self.output.emit([req])
        self.sessions.expire()
        self._restart_long_rope()
        self.admission.admit(self.running)
        plan = plan_batch(self.running, self.args.chunked_prefill_size, self.args.enable_mixed_chunk)
        if not plan:
            return had_messages
        plan, retracted = self.memory.reserve(plan, self.running, self.admission.admitted_now)
        for req in retracted:
            self.running.remove(req)
            self.admission.take_back(req)
        if not plan:  # every planned request was retracted: their room is freed, the next step plans again
            return True
        decoding = all(req.num_to_compute == 1 for req, _ in plan)  # no prefill chunk in this step
        outputs_before = sum(len(req.output_ids) for req, _ in plan)
        if self.speculator is not None:
            plan = self.speculator.draft(plan)
        forward_started = time.perf_counter()
        try:
            batch = build_forward_batch(plan, self.memory.rows, self.page_size, self.runner.device,
                                        self.runner.long_rope_from)
            logits = self.runner.forward(batch)
        except Exception as exc:
            self._fail_batch(plan, exc)
            return True
        self.forward_failures = 0
        self.forward_seconds = time.perf_counter() - forward_started
        if self.overlap and batch.is_decode and all(overlappable(req) for req, _ in plan):
            try:
                self.launched = launch(plan, logits, self.vocab_size)
                self.launched_steps += 1
            except Exception:  # sampling failed: the synchronous path samples row by row
                logger.warning("launching a decode step failed; processing it synchronously", exc_info=True)
        if self.launched is None:
            hidden = batch.hidden_states.split(batch.logits_counts) if batch.hidden_states is not None else None
            self._finish_step(self.output.process(plan, logits.split(batch.logits_counts), hidden))
        if decoding and self.launched is None:
            seconds = time.perf_counter() - started
            self._count_decode(sum(len(req.output_ids) for req, _ in plan) - outputs_before, seconds, len(plan))
            if self.speculator is not None:  # a decode or verify step's time: what a draft token costs
                self.speculator.step_timed(plan, seconds)
        self._end_step(plan, started)
        return True

    def _finish_step(self, progressed: list[Req]) -> None:
        for req in progressed:
            if req.finished:
                self._retire(req)
        self.output.emit(progressed)

    def _end_step(self, plan: Plan, started: float) -> None:
        self.steps += 1
        self.admission.decay()
        self.last_step_seconds = time.perf_counter() - started
        self._step_tokens += sum(n for _, n in plan)
        if self.args.debug_checks:
            self.check()
        self._maybe_log()

    # ----- overlap scheduling (scheduler/overlap.py) ----------------------------------------------------

    def _continue_launched(self, started: float) -> bool:
        """Launch the next decode step of the launched requests, then settle the launched one; False (nothing
        done) when something else is due, which needs the launched step settled first."""
        if any(not isinstance(msg, GenerateReq) for msg in self.inbox):
            return False
        self._take_inbox()  # new requests only: they wait
        launched = self.launched
        if self.admission.could_admit(self.running) or not launched.holds(self.running):
            return False
        plan = continuation(launched, self.context_length, self.runner.long_rope_from)
        if not plan or not self.memory.reserve_without_retraction(plan):
            return False
        try:
            batch = continuation_batch(plan, launched, self.memory.rows, self.page_size, self.runner.device,
                                       self.runner.long_rope_from)
            self.launched = launch(plan, self.runner.forward(batch), self.vocab_size, in_flight=1,
                                   sampling=continued_sampling(plan, launched))
            self.launched_steps += 1
        except Exception as exc:
            self.launched = None
            self._settle(launched)
            self._fail_batch([(req, n) for req, n in plan if not req.finished], exc)
            return True
        self.forward_failures = 0
        taken = self._settle(launched)
        self._count_decode(taken, time.perf_counter() - started, len(launched.plan))
        self._end_step(plan, started)
        return True

    def _settle(self, launched: Launched | None = None) -> int:
        """Read a launched step's tokens back and account for them (the one in flight by default); the number of
        output tokens taken (a launched request has no grammar, so it takes exactly its one token)."""
        if launched is None:
            launched, self.launched = self.launched, None
        try:
            tokens = launched.token_ids()
        except Exception as exc:  # the device failed the step: its requests fail, as for a failed forward
            self._fail_batch([(req, n) for req, n in launched.plan if not req.finished], exc)
            return 0
        progressed = []
        take_token = self.output.take_token
        for (req, _), token in zip(launched.plan, tokens):
            if req.finish_reason is not None:  # it finished when the step before was settled: this token is dropped
                continue
            try:
                take_token(req, token)
            except Exception as exc:
                self.output.finish_with_error(req, exc, "checking its output")
            progressed.append(req)
        self._finish_step(progressed)
        return len(progressed)

    def _count_decode(self, tokens: int, seconds: float, requests: int) -> None:
        """A step of ``requests`` requests without prefill chunks took ``seconds`` and gave ``tokens`` output
        tokens."""
        self.decode_tokens += tokens
        self.decode_seconds += seconds
        self.decode_steps += 1
        self.decode_requests += requests

    def _retire(self, req: Req) -> None:
        """A running request that finished gives its pages back."""
        self.running.remove(req)
        self.memory.release(req)
        self.sessions.retired(req)  # a session's finished request: its context stays pinned in the cache
        if self.speculator is not None:
            self.speculator.retired(req)

    def _fail_batch(self, plan: Plan, error: Exception) -> None:
        """The forward of this batch failed: its requests end with a server error, the others go on."""
        self.forward_failures += 1
        logger.error("the forward of a batch of %d requests failed (%d in a row): %r", len(plan),
                     self.forward_failures, error, exc_info=error)
        if self.forward_failures >= MAX_FORWARD_FAILURES:
            raise ModelFailure(f"the model's forward failed {self.forward_failures} times in a row; "
                               f"last error: {error!r}") from error
        for req, _ in plan:
            self.output.finish_with_error(req, error, "running the model's forward")
            self._retire(req)
        self.output.emit([req for req, _ in plan])

    # ----- health -------------------------------------------------------------------------------------

    def check(self) -> None:
        """Page accounting invariants (debug mode and tests)."""
        self.memory.check(self.running)

    def stats(self) -> SchedulerStats:
        return collect_stats(self)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.args.log_interval <= 0 or now - self._last_log < self.args.log_interval:
            return
        log_progress(self, self._step_tokens / (now - self._last_log))
        self._last_log, self._step_tokens = now, 0
