"""Admission: which waiting requests start running this step, in priority and policy order, within the page
budget.

The waiting queue holds requests not admitted yet and retracted ones (at its head, so first within their
priority). Each step:

- ``drop_failed_grammars`` takes out constrained requests whose grammar failed or did not compile within
  GRAMMAR_COMPILE_TIMEOUT_S (finished with a 400, for the caller to emit); a request whose grammar is still
  compiling waits without holding up the others.
- ``admit`` matches the ready requests against the cache (every one where the policy orders by matches; under
  FCFS, or a queue too long for LPM, only those it reaches), orders them by priority and then by policy
  (radixrt.scheduler.policy: a more urgent request is never passed over for lack of room), and admits while the
  chunked-prefill token budget, ``max_running_requests`` and the pages last. Pages are weighed against what
  running requests will still need: their remaining ``max_new_tokens`` times ``new_token_ratio``, an estimate
  that rises after a retraction (``take_back``) and decays while memory is calm (``decay``). When nothing
  else runs a request is admitted whatever the estimate: validation made sure it fits the pool alone.
- Priority preemption (SGLang's): a request that finds no slot or no pages retracts running requests it
  outranks by more than ``--priority-scheduling-preemption-threshold`` levels (the least urgent first, the
  latest arrival first among equals), as few as make room; if those cannot make room, none is touched. The
  victims keep their outputs and wait at the head of their priority, like requests retracted for memory.
- A request whose uncached prefix overlaps a request just admitted or still prefilling by DEDUP_MIN_TOKENS
  (and at least a page) waits, to read that prefix from the cache instead of computing it twice.
- LoRA: a request matches the cache in its adapter's namespace, and one whose adapter would make the running
  batch hold more than ``--max-loras-per-batch`` adapters waits (the requests behind it may go first).

An admitted request's pages come from ``Memory`` (hold the matched path, then take it); admission changes no
page table itself.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from radixrt.memory.radix_cache import MatchResult, RadixCache
from radixrt.protocol.messages import FinishReason
from radixrt.scheduler.memory import Memory
from radixrt.scheduler.policy import order_waiting, orders_by_match
from radixrt.scheduler.request import Req
from radixrt.server_args import ServerArgs
from radixrt.token_ids import common_prefix_len

if TYPE_CHECKING:
    from radixrt.memory.radix_cache import TreeNode

logger = logging.getLogger("radixrt.scheduler")
GRAMMAR_COMPILE_TIMEOUT_S = 30.0  # a constrained request waits at most this long for its grammar
INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per step
RETRACT_RATIO_STEP = 0.2
DEDUP_MIN_TOKENS = 32


RETRACTION_REASONS = {"memory": "under memory pressure", "preempted": "for a more urgent request",
                      "long_rope": "to compute it again with the long rotary frequencies",
                      "paused": "while generation is paused"}


class Admission:
    def __init__(self, args: ServerArgs, cache: RadixCache, memory: Memory, page_size: int) -> None:
        self.args = args
        self.cache = cache
        self.memory = memory
        self.page_size = page_size
        self.waiting: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.admitted_now: set[int] = set()  # ids of the requests the latest admission took in
        self.num_retractions = 0
        self.num_preemptions = 0
        self.num_long_rope_restarts = 0
        self.hit_tokens = 0  # prompt tokens served by the cache
        self.miss_tokens = 0  # prompt tokens computed

    # ----- the queue ----------------------------------------------------------------------------------

    def take_back(self, req: Req, reason: str = "memory") -> None:
        """A retracted request (pages released) waits at the head of the queue (first among the requests of
        its priority), to be computed again, mostly from the cache. ``reason``: ``memory`` (memory pressure: admission
        reserves more room for future decodes), ``preempted`` (for a more urgent request: that says nothing about
        memory) or ``long_rope`` (its sequence outgrew a LongRoPE model's original context: computed again with the
        long frequencies) or ``paused`` (a pause in mode retract)."""
        if not req.input_logprobs_sent:  # its prompt is computed again from the first logprob position on
            req.input_logprobs.clear()
            req.input_top_logprobs.clear()
            req.input_token_ids_logprobs.clear()
        req.num_retractions += 1
        if reason == "preempted":
            self.num_preemptions += 1
        elif reason == "memory":
            self.num_retractions += 1
            self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_STEP)
        elif reason == "long_rope":
            self.num_long_rope_restarts += 1
        self.waiting.insert(0, req)
        logger.info("retracted %s (%d outputs) %s", req.rid, len(req.output_ids), RETRACTION_REASONS[reason])

    def decay(self) -> None:
        """A step ran: the estimate of future decodes relaxes toward its floor."""
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def drop_failed_grammars(self) -> list[Req]:
        """Take the requests whose grammar failed out of the queue, finished; give the others their matcher."""
        kept: list[Req] = []
        failed: list[Req] = []
        for req in self.waiting:
            (failed if _settle_grammar(req) else kept).append(req)
        self.waiting = kept
        return failed

    # ----- admission ----------------------------------------------------------------------------------

    def could_admit(self, running: list[Req]) -> bool:
        """Whether ``admit`` might take a request in now (cheap; it may say yes where ``admit`` then finds no
        room): a request is ready (or its grammar is overdue) and a slot is free or may be preempted."""
        now = time.monotonic()
        ready = [r for r in self.waiting if r.grammar_future is None or r.grammar_future.done()
                 or now - r.arrival > GRAMMAR_COMPILE_TIMEOUT_S]
        return bool(ready) and (len(running) < self.args.max_running_requests or self._may_preempt(ready, running))

    def admit(self, running: list[Req]) -> None:
        """Move the requests that fit from the waiting queue to the end of ``running``."""
        self.admitted_now = set()  # a step that admits nothing must not leave an earlier step's set behind
        ready = [r for r in self.waiting if r.grammar_future is None or r.grammar_future.done()]
        if not ready or (len(running) >= self.args.max_running_requests and not self._may_preempt(ready, running)):
            return
        matches: dict[str, tuple[int, TreeNode]] = {}
        if orders_by_match(self.args.schedule_policy, len(ready)):
            for req in ready:
                matches[req.rid] = self._matched(req)
        budget = self.args.chunked_prefill_size
        committed = sum(self._future_pages(r) for r in running)  # pages promised, not yet allocated
        admitted: list[Req] = []
        prefilling = [r for r in running if r.num_to_compute > 1]  # what an admitted prompt may share a prefix with
        adapters = {r.lora_uid for r in running if r.lora_uid}
        order = order_waiting(self.args.schedule_policy, ready, matches,
                              self.args.schedule_low_priority_values_first)
        for req in order:
            if budget <= 0:
                break
            if req.rid not in matches:  # an order that reads no match: only the requests reached are matched
                matches[req.rid] = self._matched(req)
            if self._shares_uncached_prefix(req, prefilling, matches[req.rid][0]):
                continue
            if req.lora_uid and req.lora_uid not in adapters and len(adapters) >= self.args.max_loras_per_batch:
                continue  # its adapter would be one too many in the batch: it waits for one to finish
            full = len(running) >= self.args.max_running_requests
            pages = None if full else self._take_in(req, committed, alone=not running)
            if pages is None:
                released = self._preempt_for(req, running, admitted, committed)
                if released is None:
                    break
                committed -= released
                still = {id(r) for r in running}  # the preempted left
                prefilling = [r for r in prefilling if id(r) in still]
                pages = self._take_in(req, committed, alone=not running)
                if pages is None:  # the estimate of the victims' pages was too generous; they run again later
                    break
            committed += pages
            budget -= req.num_to_compute
            if req.lora_uid:
                adapters.add(req.lora_uid)
            admitted.append(req)
            running.append(req)
            prefilling.append(req)
        self.admitted_now = {id(r) for r in admitted}
        if admitted:
            self.waiting = [r for r in self.waiting if id(r) not in self.admitted_now]

    def _take_in(self, req: Req, committed: int, alone: bool) -> int | None:
        """Give ``req`` its cached prefix if its pages fit (or it would run ``alone``); returns the pages it is
        promised, or None if it waits."""
        match = self._match(req)
        self.memory.hold(match.node)
        wanted = self._pages_wanted(req, len(match.pages))
        # Measured after the hold: the matched pages are no longer evictable, so they are not room.
        short = wanted - (self.memory.available_pages - committed)
        # Sessions' pins yield to a request that needs the room; one whose path a running turn also holds frees
        # nothing, so the next least recently used goes too, until the room is there or no pin is left.
        while (0 < short <= self.cache.protected_pages and not alone and self.memory.unpin is not None
               and self.memory.unpin(short)):
            short = wanted - (self.memory.available_pages - committed)
        if wanted > self.memory.available_pages - committed and not alone:
            self.memory.unhold(match.node)
            return None
        self.memory.take_match(req, match)
        if req.num_retractions == 0:  # count a request's lookup once, when it is admitted
            self.cache.record(match.num_tokens, self._match_limit(req))
            req.cached_tokens = req.num_computed
            self.hit_tokens += req.num_computed
            self.miss_tokens += len(req.prompt_ids) - req.num_computed
        return wanted

    def _pages_wanted(self, req: Req, matched_pages: int) -> int:
        """Pages a request needs to start (its uncached tokens and the next one) plus the room reserved for
        its future decodes."""
        need = math.ceil((req.total_len + 1) / self.page_size) - matched_pages
        remaining = max(req.params.max_new_tokens - len(req.output_ids), 0)
        return need + math.ceil(remaining * self.new_token_ratio / self.page_size)

    def _matched(self, req: Req) -> tuple[int, TreeNode]:
        """The request's cached tokens (partial page included) and the deepest node they reach."""
        m = self._match(req)
        return m.num_tokens + m.partial_tokens, m.node

    def _match(self, req: Req) -> MatchResult:
        """The request's cached prefix (in its namespace: its adapter's, its isolation key's), unrecorded."""
        return self.cache.match_prefix(req.fill_ids[: self._match_limit(req)], record=False,
                                       namespace=req.cache_namespace)

    def _match_limit(self, req: Req) -> int:
        """Tokens the cache may serve: never the last one (its logits are needed), nor prompt logprob rows, nor
        tokens that may still change (``Req.final_len``), nor any token of an embedding pooled over every token."""
        limit = min(req.total_len - 1, req.final_len)
        if req.computes_prompt_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        if req.pools_every_token:
            limit = 0
        return limit

    def _future_pages(self, req: Req) -> int:
        remaining = max(req.params.max_new_tokens - len(req.output_ids), 0)
        target = req.total_len + math.ceil(remaining * self.new_token_ratio)
        return max(math.ceil(target / self.page_size) - len(req.pages), 0)

    def _shares_uncached_prefix(self, req: Req, prefilling: list[Req], cached: int) -> bool:
        """Whether ``req`` shares more than its cached prefix with a request whose prompt is still to be computed
        (``prefilling``: those running with tokens to compute, and the ones admitted this step): it waits, so
        that the shared part is computed once and cached."""
        if self.cache.disabled:
            return False
        need = cached + max(DEDUP_MIN_TOKENS, self.page_size)  # a common prefix at least this long
        if req.total_len < need:
            return False
        fill, last = req.fill_ids, need - 1
        for other in prefilling:
            # the last token such a prefix would hold first: most requests differ there (one comparison, no copy)
            if (other.total_len < need or other.token_at(last) != fill[last]
                    or other.cache_namespace != req.cache_namespace):
                continue
            if common_prefix_len(fill, other.fill_ids) >= need:
                return True
        return False

    # ----- priority preemption ------------------------------------------------------------------------

    def _outranks(self, req: Req, other: Req) -> bool:
        low = self.args.schedule_low_priority_values_first
        return req.urgency(low) - other.urgency(low) > self.args.priority_scheduling_preemption_threshold

    def _may_preempt(self, ready: list[Req], running: list[Req]) -> bool:
        """Whether some ready request outranks some running one (cheap; admission with full slots skips the
        prefix matching otherwise)."""
        if self.args.disable_priority_preemption or not running:
            return False
        low = self.args.schedule_low_priority_values_first
        most = max(ready, key=lambda r: r.urgency(low))
        least = min(running, key=lambda r: r.urgency(low))
        return self._outranks(most, least)

    def _preempt_for(self, req: Req, running: list[Req], admitted: list[Req], committed: int) -> int | None:
        """Retract the fewest running requests ``req`` outranks (least urgent first, latest arrival first) that
        give it a slot and its pages. Returns the pages the victims had been promised (no longer committed),
        or None when they could not make room (then none is touched). Requests admitted in this step are
        never victims."""
        if self.args.disable_priority_preemption:
            return None
        just_admitted = {id(r) for r in admitted}
        low = self.args.schedule_low_priority_values_first
        victims = sorted((r for r in running if id(r) not in just_admitted and self._outranks(req, r)),
                         key=lambda r: (r.urgency(low), -r.arrival))
        if not victims:
            return None
        match = self._match(req)
        matched = set(match.pages)
        short_slots = len(running) + 1 - self.args.max_running_requests
        short_pages = self._pages_wanted(req, len(match.pages)) - (self.memory.available_pages - committed)
        chosen: list[Req] = []
        for victim in victims:
            if short_slots <= 0 and (short_pages <= 0 or len(chosen) == len(running)):
                break
            chosen.append(victim)
            short_slots -= 1
            # What its release gives back at most: its pages (those req matched stay held) and its promise.
            short_pages -= sum(p not in matched for p in victim.pages) + self._future_pages(victim)
        if short_slots > 0 or (short_pages > 0 and len(chosen) < len(running)):
            return None
        released = 0
        for victim in chosen:
            released += self._future_pages(victim)
            running.remove(victim)
            self.memory.release(victim)
            self.take_back(victim, "preempted")
        return released


def _settle_grammar(req: Req) -> bool:
    """A constrained request whose grammar compiled gets its matcher; one whose grammar failed or timed out is
    finished with a 400 (True)."""
    future = req.grammar_future
    if future is None or req.grammar is not None:
        return False
    if not future.done():
        # A grammar whose token index takes minutes to build (e.g. a JSON schema with a large minItems)
        # must not leave its client waiting forever: refuse it after a deadline.
        if time.monotonic() - req.arrival < GRAMMAR_COMPILE_TIMEOUT_S:
            return False
        future.cancel()
        req.finish_reason = FinishReason.error(f"invalid grammar: too complex, it did not compile within "
                                               f"{GRAMMAR_COMPILE_TIMEOUT_S:.0f} s", 400)
        return True
    error = future.exception()
    if error is None:
        try:
            req.grammar = future.result().matcher()
            return False
        except Exception as exc:
            error = exc
    req.finish_reason = FinishReason.error(f"invalid grammar: {error}", 400)
    return True
