"""The step loop: admit by policy within the page budget, build one batch, forward, sample, finish.

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
import math
import random
import threading
import time
from collections import deque
from typing import Callable

import torch

from radixrt.memory.page_pool import OutOfPagesError
from radixrt.memory.radix_cache import RadixCache
from radixrt.messages import AbortReq, BatchTokenOut, FlushCacheReq, GenerateReq, ReqDelta, SchedulerStats
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.runner import ModelRunner
from radixrt.detokenize import TextStream
from radixrt.sampling.logits_processor import apply_penalties, ban_tokens, token_logprobs
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import SamplingBatch, sample
from radixrt.scheduler.policy import POLICIES, order_waiting
from radixrt.scheduler.request import Req
from radixrt.scheduler.validation import ModelLimits, RequestError, validate_request
from radixrt.server_args import ServerArgs
from radixrt.token_ids import common_prefix_len

logger = logging.getLogger("radixrt.scheduler")
GRAMMAR_COMPILE_TIMEOUT_S = 30.0  # a constrained request waits at most this long for its grammar

# Admission reserves pages for the future decodes of running requests, estimated as this fraction of their
# remaining max_new_tokens. It rises after a retraction and decays back while memory is calm.
INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
RETRACT_RATIO_STEP = 0.2
# A waiting request whose uncached prefix overlaps, by this many tokens, a request admitted this step or one
# still in chunked prefill waits, then reads that prefix from the cache instead of computing it twice.
DEDUP_MIN_TOKENS = 32
# Jump-forward (constrained decoding) may re-tokenise a request's latest output tokens. Only tokens not yet
# sent are ever dropped, so a constrained request's last JUMP_FORWARD_HOLD tokens are held back from
# emission until they are final (or the request finishes): the detokenizer only ever sees final tokens.
JUMP_FORWARD_HOLD = 4
# Forward failures in a row after which the model is taken to be unable to run (the step raises ModelFailure).
MAX_FORWARD_FAILURES = 3


class ModelFailure(RuntimeError):
    """The model's forward keeps failing: the runtime cannot serve any request."""


def error_reason(message: str, status_code: int) -> dict:
    """The finish reason of a request that ended in error (SGLang's abort, with an HTTP status code)."""
    return {"type": "abort", "message": message, "status_code": status_code}


class ControlCall:
    """A function the scheduler runs between steps, on its own thread (flush, stats snapshots)."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as exc:
            self.error = exc
        self.done.set()


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        tokenizer,
        eos_ids: set[int],
        sink: Callable[[BatchTokenOut], None],
        grammars=None,
    ) -> None:
        if args.schedule_policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {args.schedule_policy!r}; choose one of {POLICIES}")
        if args.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")
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
        self.inbox: deque = deque()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self.steps = 0
        self.last_step_seconds = 0.0
        self.forward_seconds = 0.0
        self._last_log = time.monotonic()
        self._step_tokens = 0
        self.hit_tokens = 0  # prompt tokens served by the cache
        self.miss_tokens = 0  # prompt tokens computed
        self.jump_forwards = 0
        self.jump_forward_tokens = 0
        self.forward_failures = 0  # in a row
        # Requests without a seed of their own draw one here in arrival order: the same requests in the same
        # order sample the same tokens run after run.
        self._seeds = random.Random(args.random_seed)
        self._admitted_this_step: set[int] = set()

    # ----- intake -------------------------------------------------------------------------------------

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(vocab_size=self.vocab_size, context_length=self.context_length,
                           page_size=self.page_size, num_pages=self.pool.num_pages)

    def validate(self, msg: GenerateReq) -> None:
        """Raise RequestError for a request that can never be served. Safe to call from any thread."""
        validate_request(msg.input_ids, msg.params, self.limits, return_logprob=msg.return_logprob,
                         logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num)

    def submit(self, msg: GenerateReq | AbortReq | FlushCacheReq | ControlCall) -> None:
        """Thread-safe: messages are taken in at the start of the next step."""
        self.inbox.append(msg)

    def _take_inbox(self) -> None:
        while self.inbox:
            msg = self.inbox.popleft()
            if isinstance(msg, GenerateReq):
                self._add_request(msg)
            elif isinstance(msg, AbortReq):
                self._abort(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                self.flush_cache()
            elif isinstance(msg, ControlCall):
                msg.run()

    def fail_control_calls(self, error: BaseException) -> None:
        """The step loop is gone: answer every queued control call with ``error``."""
        while self.inbox:
            msg = self.inbox.popleft()
            if isinstance(msg, ControlCall):
                msg.error = error
                msg.done.set()

    def _add_request(self, msg: GenerateReq) -> None:
        seed = self._seeds.getrandbits(63)
        try:
            self.validate(msg)
            req = Req.from_message(msg, seed, self.runner.device)
        except RequestError as exc:
            self._refuse(msg, error_reason(str(exc), 400))
            return
        except Exception as exc:  # e.g. a seed the generator refuses: this request's error only
            logger.exception("could not take in request %s", msg.rid)
            self._refuse(msg, error_reason(f"invalid request: {exc!r}", 400))
            return
        req.arrival = time.monotonic()
        if msg.grammar is not None and self.grammars is None:
            self._finish(req, error_reason("constrained decoding is not available", 400))
            self._emit([req])
            return
        try:
            if req.params.stop:
                req.stop_text = TextStream(self.tokenizer, req.params.stop, req.params.skip_special_tokens)
            if msg.grammar is not None:
                req.grammar_future = self.grammars.compile_async(*msg.grammar)
        except Exception as exc:
            self._fail(req, exc, "preparing the request")
            return
        self.waiting.append(req)

    def _refuse(self, msg: GenerateReq, reason: dict) -> None:
        self.sink(BatchTokenOut([ReqDelta(rid=msg.rid, new_ids=[], finish_reason=reason,
                                          prompt_tokens=len(msg.input_ids))]))

    def _abort(self, rid: str) -> None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._release(req)
                    self._finish(req, {"type": "abort", "message": "aborted", "status_code": 499})
                    self._emit([req])
                    return

    def flush_cache(self) -> bool:
        """Drop every cached page; only possible while nothing runs."""
        if self.running or self.waiting:
            return False
        self.cache.reset()
        return True

    @property
    def idle(self) -> bool:
        return not (self.inbox or self.waiting or self.running)

    # ----- one step -----------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one scheduling step; returns False when there was nothing to do."""
        started = time.perf_counter()
        had_messages = bool(self.inbox)
        self._take_inbox()
        self._admit()
        plan = self._plan()
        if not plan:
            return had_messages
        plan = self._reserve_pages(plan)
        if not plan:  # every planned request was retracted: their room is freed, the next step plans again
            return True
        forward_started = time.perf_counter()
        try:
            batch = ForwardBatch.build(
                [SeqChunk(req.fill_ids[req.num_computed : req.num_computed + n], req.num_computed, req.pages,
                          self._logits_from(req, n)) for req, n in plan],
                self.page_size,
                self.runner.device,
            )
            logits = self.runner.forward(batch)
        except Exception as exc:
            self._fail_batch(plan, exc)
            return True
        self.forward_failures = 0
        self.forward_seconds = time.perf_counter() - forward_started
        self._process(plan, logits.split(batch.logits_counts))
        self.steps += 1
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self.last_step_seconds = time.perf_counter() - started
        self._step_tokens += sum(n for _, n in plan)
        if self.args.debug_checks:
            self.check()
        self._maybe_log()
        return True

    # ----- admission ----------------------------------------------------------------------------------

    def _match_limit(self, req: Req) -> int:
        """Tokens the cache may serve: never the last one (its logits are needed), nor prompt logprob rows."""
        limit = req.total_len - 1
        if req.computes_prompt_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit

    def _future_pages(self, req: Req) -> int:
        remaining = max(req.params.max_new_tokens - len(req.output_ids), 0)
        target = req.total_len + math.ceil(remaining * self.new_token_ratio)
        return max(math.ceil(target / self.page_size) - len(req.pages), 0)

    def _admit(self) -> None:
        self.waiting = [r for r in self.waiting if not self._grammar_failed(r)]
        ready = [r for r in self.waiting if self._grammar_ready(r)]
        if not ready or len(self.running) >= self.args.max_running_requests:
            return
        matches = {}
        for req in ready:
            m = self.cache.match_prefix(req.fill_ids[: self._match_limit(req)], record=False)
            matches[req.rid] = (m.num_tokens + m.partial_tokens, m.node)
        budget = self.args.chunked_prefill_size
        committed = sum(self._future_pages(r) for r in self.running)  # pages promised, not yet allocated
        admitted: list[Req] = []
        for req in order_waiting(self.args.schedule_policy, ready, matches):
            if budget <= 0 or len(self.running) >= self.args.max_running_requests:
                break
            if self._shares_uncached_prefix(req, admitted, matches[req.rid][0]):
                continue
            match = self.cache.match_prefix(req.fill_ids[: self._match_limit(req)], record=False)
            self.cache.lock(match.node)
            need = math.ceil((req.total_len + 1) / self.page_size) - len(match.pages)
            reserve = math.ceil(
                max(req.params.max_new_tokens - len(req.output_ids), 0) * self.new_token_ratio / self.page_size
            )
            # Measured after the lock: the matched pages are no longer evictable, so they are not room.
            available = self.pool.num_free + self.cache.evictable_pages - committed
            if need + reserve > available and (self.running or admitted):
                self.cache.unlock(match.node)
                break
            req.node = match.node
            req.pages = list(match.pages)
            req.num_tree_pages = len(match.pages)
            req.num_computed = match.num_tokens
            reused = self.cache.reuse_partial(match) if match.partial_tokens else None
            if reused is not None:
                page, tokens = reused
                req.pages.append(page)
                req.num_computed += tokens
            if req.num_retractions == 0:  # count a request's lookup once, when it is admitted
                self.cache.record(match.num_tokens, self._match_limit(req))
                req.cached_tokens = req.num_computed
                self.hit_tokens += req.num_computed
                self.miss_tokens += len(req.prompt_ids) - req.num_computed
            committed += need + reserve
            budget -= req.num_to_compute
            admitted.append(req)
            self.running.append(req)
        self._admitted_this_step = {id(r) for r in admitted}
        if admitted:
            self.waiting = [r for r in self.waiting if id(r) not in self._admitted_this_step]

    def _shares_uncached_prefix(self, req: Req, admitted: list[Req], cached: int) -> bool:
        if self.cache.disabled:
            return False
        just_admitted = {id(r) for r in admitted}
        fill = req.fill_ids
        for other in self.running:  # the admitted ones included
            if other.num_to_compute <= 1 and id(other) not in just_admitted:
                continue
            common = common_prefix_len(fill, other.fill_ids)
            if common - cached >= max(DEDUP_MIN_TOKENS, self.page_size):
                return True
        return False

    def _grammar_ready(self, req: Req) -> bool:
        """A constrained request waits (without holding up others) until its grammar has compiled."""
        return req.grammar_future is None or req.grammar_future.done()

    def _grammar_failed(self, req: Req) -> bool:
        future = req.grammar_future
        if future is None or req.grammar is not None:
            return False
        if not future.done():
            # A grammar whose token index takes minutes to build (e.g. a JSON schema with a large minItems)
            # must not leave its client waiting forever: refuse it after a deadline.
            if time.monotonic() - req.arrival < GRAMMAR_COMPILE_TIMEOUT_S:
                return False
            future.cancel()
            self._finish(req, error_reason(f"invalid grammar: too complex, it did not compile within "
                                           f"{GRAMMAR_COMPILE_TIMEOUT_S:.0f} s", 400))
            self._emit([req])
            return True
        error = future.exception()
        if error is None:
            try:
                req.grammar = future.result().matcher()
                return False
            except Exception as exc:
                error = exc
        self._finish(req, error_reason(f"invalid grammar: {error}", 400))
        self._emit([req])
        return True

    # ----- batch planning and memory ------------------------------------------------------------------

    def _plan(self) -> list[tuple[Req, int]]:
        """Prefills share the chunked-prefill token budget in admission order. While any prefill runs, decodes
        wait (prefill first, as SGLang does: the fewest steps for a batch of prompts) unless
        ``enable_mixed_chunk`` rides them along in the same step (steadier inter-token latency)."""
        budget = self.args.chunked_prefill_size
        plan: list[tuple[Req, int]] = []
        has_prefill = False
        for req in self.running:
            todo = req.num_to_compute
            if todo == 1:
                plan.append((req, 1))
            elif budget > 0:
                n = min(todo, budget)
                budget -= n
                plan.append((req, n))
                has_prefill = True
        if has_prefill and not self.args.enable_mixed_chunk:
            plan = [(req, n) for req, n in plan if req.num_to_compute > 1]
        return plan

    def _pages_short(self, plan: list[tuple[Req, int]]) -> int:
        need = sum(max(math.ceil((r.num_computed + n) / self.page_size) - len(r.pages), 0) for r, n in plan)
        return need - self.pool.num_free

    def _reserve_pages(self, plan: list[tuple[Req, int]]) -> list[tuple[Req, int]]:
        """Give every planned request the pages its new tokens need: evict, then retract if that is not enough."""
        short = self._pages_short(plan)
        if short > 0:
            self.cache.evict(short)
            short = self._pages_short(plan)
        while short > 0:
            if len(self.running) == 1:
                raise OutOfPagesError("a single request does not fit in the KV pool")  # prevented by validate()
            # The fewest outputs lose the least work; a request admitted this step goes last, since its
            # admission counted on the room.
            victim = min(self.running, key=lambda r: (id(r) in self._admitted_this_step, len(r.output_ids),
                                                      -r.arrival))
            self._retract(victim)
            plan = [(r, n) for r, n in plan if r is not victim]
            self.cache.evict(max(self._pages_short(plan), 0))
            short = self._pages_short(plan)
        for req, n in plan:
            need = math.ceil((req.num_computed + n) / self.page_size) - len(req.pages)
            if need > 0:
                req.pages.extend(self.pool.alloc(need))
        return plan

    def _retract(self, req: Req) -> None:
        """Memory pressure: drop a request's pages (keeping what it computed in the cache) and requeue it."""
        self.running.remove(req)
        self._release(req)
        if not req.input_logprobs_sent:  # its prompt is computed again from the first logprob position on
            req.input_logprobs.clear()
            req.input_top_logprobs.clear()
        req.num_retractions += 1
        self.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_STEP)
        self.waiting.insert(0, req)
        logger.info("retracted %s (%d outputs) under memory pressure", req.rid, len(req.output_ids))

    def _release(self, req: Req) -> None:
        """Hand the request's computed whole pages to the cache, free the rest, unlock its path."""
        if req.node is None and not req.pages:
            return
        whole = min(req.num_computed // self.page_size, len(req.pages))
        result = self.cache.insert(req.fill_ids[: whole * self.page_size], req.pages[:whole])
        kept = set(result.tree_pages)
        private = [p for p in req.pages[req.num_tree_pages :] if p not in kept]
        self.pool.decref(private)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node, req.pages, req.num_tree_pages = None, [], 0
        req.num_computed = 0

    def _cache_prefix(self, req: Req) -> None:
        """After a prefill chunk: put the request's computed whole pages in the tree for others to share."""
        whole = req.num_computed // self.page_size
        if self.cache.disabled or whole <= req.num_tree_pages:
            return
        result = self.cache.insert(req.fill_ids[: whole * self.page_size], req.pages[:whole])
        kept = set(result.tree_pages)
        self.pool.decref([p for p in result.duplicates if p not in kept])
        req.pages[: len(result.tree_pages)] = result.tree_pages
        self.cache.lock(result.node)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node = result.node
        req.num_tree_pages = len(result.tree_pages)

    # ----- after the forward --------------------------------------------------------------------------

    def _logits_from(self, req: Req, n: int) -> int:
        """First row of this chunk whose logits are needed (prompt logprobs start early)."""
        if req.computes_prompt_logprobs:
            first_position = max(req.logprob_start_len - 1, 0)
            if first_position < req.num_computed + n:
                return max(first_position - req.num_computed, 0)
        return n - 1

    def _fail_batch(self, plan: list[tuple[Req, int]], error: Exception) -> None:
        """The forward of this batch failed: its requests end with a server error, the others go on."""
        self.forward_failures += 1
        logger.error("the forward of a batch of %d requests failed (%d in a row): %r", len(plan),
                     self.forward_failures, error, exc_info=error)
        if self.forward_failures >= MAX_FORWARD_FAILURES:
            raise ModelFailure(f"the model's forward failed {self.forward_failures} times in a row; "
                               f"last error: {error!r}") from error
        for req, _ in plan:
            self._error_finish(req, error, "running the model's forward")
            self.running.remove(req)
            self._release(req)
        self._emit([req for req, _ in plan])

    def _error_finish(self, req: Req, error: Exception, doing: str) -> None:
        if req.finished:
            return
        logger.error("request %s failed while %s: %r", req.rid, doing, error, exc_info=error)
        self._finish(req, error_reason(f"internal error while {doing}: {error!r}", 500))

    def _fail(self, req: Req, error: Exception, doing: str) -> None:
        """A request not queued yet fails: finish it with a server error and tell its client."""
        self._error_finish(req, error, doing)
        self._emit([req])

    def _advance(self, req: Req, n: int, rows: torch.Tensor) -> bool:
        """Account for ``n`` computed tokens of ``req``; True when its next token is to be sampled now."""
        start = req.num_computed
        if req.computes_prompt_logprobs:
            self._collect_prompt_logprobs(req, start, n, rows)
        req.num_computed += n
        if n > 1 and start < len(req.prompt_ids):  # a prefill chunk (not a jump-forward extend)
            self._cache_prefix(req)
        if req.num_computed < req.total_len:
            return False  # a prefill chunk that does not reach the end yet
        if req.params.max_new_tokens == 0:  # prompt only: logprobs, or prefilling a shared prefix
            self._finish(req, {"type": "length", "matched": None})
            return False
        return True

    def _sample_each(self, reqs: list[Req], rows: list[torch.Tensor]) -> list[int | None]:
        """Sample the batch at once; if that fails, one request at a time, so only the culprits fail."""
        try:
            return list(self._sample(reqs, torch.stack(rows)))
        except Exception as batch_error:
            logger.warning("sampling a batch of %d failed (%r); sampling its requests one by one", len(reqs),
                           batch_error)
        tokens: list[int | None] = []
        for req, row in zip(reqs, rows):
            try:
                tokens.append(self._sample([req], row[None])[0])
            except Exception as exc:
                self._error_finish(req, exc, "sampling")
                tokens.append(None)
        return tokens

    def _take_token(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        self._check_finish(req, token)
        if not req.finished and req.grammar is not None:
            self._jump_forward(req)

    def _process(self, plan: list[tuple[Req, int]], logits_rows: tuple[torch.Tensor, ...]) -> None:
        samplers: list[Req] = []
        last_rows: list[torch.Tensor] = []
        for (req, n), rows in zip(plan, logits_rows):
            try:
                if self._advance(req, n, rows):
                    samplers.append(req)
                    last_rows.append(rows[-1])
            except Exception as exc:
                self._error_finish(req, exc, "reading its logits")
        if samplers:
            for req, token in zip(samplers, self._sample_each(samplers, last_rows)):
                if token is None:
                    continue
                try:
                    self._take_token(req, token)
                except Exception as exc:
                    self._error_finish(req, exc, "checking its output")
        progressed = [req for req, _ in plan if req.num_computed == req.total_len - 1 or req.finished]
        for req in progressed:
            if req.finished:
                self.running.remove(req)
                self._release(req)
        self._emit(progressed)

    def _collect_prompt_logprobs(self, req: Req, start: int, n: int, rows: torch.Tensor) -> None:
        """Row i of ``rows`` holds the logits after position ``start + n - len(rows) + i``."""
        first_row_position = start + n - rows.shape[0]
        prompt_len = len(req.prompt_ids)
        if req.logprob_start_len == 0 and not req.input_logprobs and start == 0:
            req.input_logprobs.append((None, req.prompt_ids[0]))
            if req.top_logprobs_num:
                req.input_top_logprobs.append([])
        positions = [first_row_position + i for i in range(rows.shape[0])]
        keep = [i for i, q in enumerate(positions)
                if max(req.logprob_start_len - 1, 0) <= q < prompt_len - 1 and q + 1 >= req.logprob_start_len]
        if not keep:
            return
        targets = torch.tensor([req.prompt_ids[positions[i] + 1] for i in keep], device=rows.device)
        logprobs = torch.log_softmax(rows[keep].float(), dim=-1)
        chosen, top = token_logprobs(logprobs, targets, req.top_logprobs_num)
        req.input_logprobs.extend(zip(chosen, targets.tolist()))
        if top is not None:
            req.input_top_logprobs.extend(top)

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> list[int]:
        params = [r.params for r in reqs]
        raw = logits
        logits = logits.clone()
        apply_penalties(logits, params, [r.prompt_ids for r in reqs], [r.output_ids for r in reqs])
        banned = []
        for r in reqs:
            ids: list[int] = []
            if len(r.output_ids) < r.params.min_new_tokens:
                ids = sorted((set() if r.params.ignore_eos else self.eos_ids) | set(r.params.stop_token_ids or []))
            banned.append(ids)
        ban_tokens(logits, banned)
        if any(r.grammar is not None for r in reqs):
            self.grammars.apply_masks(logits, [r.grammar for r in reqs])
        batch = SamplingBatch.build(params, self.vocab_size, [r.generator for r in reqs], device=logits.device)
        tokens = sample(logits, batch)
        token_ids = tokens.tolist()  # one device-to-host copy for the batch
        wants = [i for i, r in enumerate(reqs) if r.return_logprob]
        if wants:
            top_k = max(reqs[i].top_logprobs_num for i in wants)
            logprobs = torch.log_softmax(raw[wants].float(), dim=-1)
            chosen, top = token_logprobs(logprobs, tokens[wants], top_k)
            for j, i in enumerate(wants):
                reqs[i].pending_output_logprobs.append((chosen[j], token_ids[i]))
                if reqs[i].top_logprobs_num:
                    reqs[i].pending_output_top.append(top[j][: reqs[i].top_logprobs_num])
        return token_ids

    def _jump_forward(self, req: Req) -> None:
        """Append the text the grammar forces now; the next step computes it as one extend chunk.

        Only output tokens that were neither sent (see JUMP_FORWARD_HOLD) nor put in tree pages may be
        re-tokenised, so a drop never changes streamed text nor touches shared KV. Dropped tokens that had
        KV leave their slots in private pages, overwritten by the extend. Not for logprob requests (the
        appended tokens were not sampled).
        """
        if req.return_logprob or not self.grammars.jump_forward_enabled:
            return
        frozen = max(req.num_sent, req.num_tree_pages * self.page_size - len(req.prompt_ids), 0)
        room = min(req.params.max_new_tokens - len(req.output_ids), self.context_length - req.total_len)
        if room < 1 or frozen >= len(req.output_ids):
            return
        jf = self.grammars.jump_forward(req.grammar, req.output_ids[frozen:], max_tokens_to_append=room)
        if jf is None:
            return
        if jf.num_tokens_to_drop:
            del req.output_ids[len(req.output_ids) - jf.num_tokens_to_drop :]
            req.num_computed = min(req.num_computed, req.total_len)
        req.output_ids.extend(jf.tokens_to_append)
        if req.num_computed >= req.total_len:  # nothing appended (cannot happen with room >= 1): recompute the last
            req.num_computed = req.total_len - 1
        self.jump_forwards += 1
        self.jump_forward_tokens += len(jf.tokens_to_append) - jf.num_tokens_to_drop
        if req.stop_text is not None:  # re-render the stop-string check over the new token sequence
            req.stop_text = TextStream(self.tokenizer, req.params.stop, req.params.skip_special_tokens)
            req.stop_text.add(req.output_ids)
            if req.stop_text.stopped_at is not None:
                self._finish(req, {"type": "stop", "matched": req.stop_text.stopped_at})
                return
        if req.grammar.is_finished():
            self._finish(req, {"type": "stop", "matched": None})
        elif len(req.output_ids) >= req.params.max_new_tokens or req.total_len >= self.context_length:
            self._finish(req, {"type": "length", "matched": None})

    def _check_finish(self, req: Req, token: int) -> None:
        params = req.params
        if req.grammar is not None and not req.grammar.accept_token(token):
            self._finish(req, error_reason(f"constrained decoding: the grammar rejected token {token}", 500))
            return
        if token in (params.stop_token_ids or []) or (token in self.eos_ids and not params.ignore_eos):
            self._finish(req, {"type": "stop", "matched": token})
            return
        if req.stop_text is not None:
            req.stop_text.add([token])
            if req.stop_text.stopped_at is not None:
                self._finish(req, {"type": "stop", "matched": req.stop_text.stopped_at})
                return
        if req.grammar is not None and req.grammar.is_finished():
            self._finish(req, {"type": "stop", "matched": None})
            return
        if len(req.output_ids) >= params.max_new_tokens or req.total_len >= self.context_length:
            self._finish(req, {"type": "length", "matched": None})

    def _finish(self, req: Req, reason: dict) -> None:
        req.finish_reason = reason

    def _emit(self, reqs: list[Req]) -> None:
        deltas = []
        for req in reqs:
            end = len(req.output_ids)
            if req.grammar is not None and req.finish_reason is None and not req.return_logprob \
                    and self.grammars.jump_forward_enabled:
                end = max(req.num_sent, end - JUMP_FORWARD_HOLD)  # may still be re-tokenised by jump-forward
            delta = ReqDelta(
                rid=req.rid,
                new_ids=req.output_ids[req.num_sent : end],
                finish_reason=req.finish_reason,
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
                completion_tokens=len(req.output_ids),
            )
            if req.num_sent == 0 and not req.input_logprobs_sent:
                delta.stop = req.params.stop
                delta.skip_special_tokens = req.params.skip_special_tokens
            if req.return_logprob:
                delta.output_logprobs, req.pending_output_logprobs = req.pending_output_logprobs, []
                if req.top_logprobs_num:
                    delta.output_top_logprobs, req.pending_output_top = req.pending_output_top, []
                if not req.input_logprobs_sent and req.wants_prompt_logprobs:
                    delta.input_logprobs = list(req.input_logprobs)  # a copy: the request lives on
                    delta.input_top_logprobs = list(req.input_top_logprobs) if req.top_logprobs_num else None
            req.input_logprobs_sent = True
            req.num_sent = end
            deltas.append(delta)
        if deltas:
            self.sink(BatchTokenOut(deltas))

    # ----- health -------------------------------------------------------------------------------------

    def check(self) -> None:
        """Page accounting invariants (debug mode and tests)."""
        private = [p for r in self.running for p in r.pages[r.num_tree_pages :]]
        assert len(private) == len(set(private)), "a private page is listed twice"
        self.cache.check(private)
        total = self.pool.num_free + self.cache.cached_pages + len(private)
        assert total == self.pool.num_pages, f"pages leak: free+cached+private={total} of {self.pool.num_pages}"

    def stats(self) -> SchedulerStats:
        s = self.cache.stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            pages_total=self.pool.num_pages,
            pages_free=self.pool.num_free,
            pages_evictable=self.cache.evictable_pages,
            pages_protected=self.cache.protected_pages,
            pages_private=sum(len(r.pages) - r.num_tree_pages for r in self.running),
            cache_hit_tokens=self.hit_tokens,
            cache_miss_tokens=self.miss_tokens,
            partial_tokens_reused=s.partial_tokens_reused,
            evicted_pages=s.evicted_pages,
            num_retractions=self.num_retractions,
            last_step_seconds=self.last_step_seconds,
            steps=self.steps,
            jump_forwards=self.jump_forwards,
            jump_forward_tokens=self.jump_forward_tokens,
        )

    def _maybe_log(self) -> None:
        interval = self.args.log_interval
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        s = self.stats()
        hit = s.cache_hit_tokens / max(s.cache_hit_tokens + s.cache_miss_tokens, 1)
        logger.info(
            "step %d: running %d, waiting %d, %.1f tok/s, pages used %d/%d (evictable %d), cache hit %.1f%%, "
            "retractions %d", s.steps, s.num_running, s.num_waiting, self._step_tokens / (now - self._last_log),
            s.pages_total - s.pages_free, s.pages_total, s.pages_evictable, 100 * hit, s.num_retractions,
        )
        self._last_log, self._step_tokens = now, 0
