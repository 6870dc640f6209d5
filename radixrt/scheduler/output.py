"""After the forward: each request's logits become progress, a next token, perhaps its finish; then deltas.

``process`` takes a planned request ``(req, n)`` over its ``n`` computed tokens (prompt logprobs; a prefill
chunk's whole pages go to the cache) and, once its whole fill is computed, samples its next token (an embedding
request instead finishes with its pooled hidden state, radixrt.scheduler.embedding). The token
is checked against the grammar, stop tokens, stop strings and the length limits, then jump-forward may append
what the grammar forces. ``process`` returns the requests that progressed (a token is due, or finished); the
caller releases the finished ones' pages, then ``emit`` sends one ReqDelta per request, in one BatchTokenOut.

A decode with a speculative draft (radixrt.scheduler.speculation) is verified instead: every row gives the
token the request would have produced there, the draft's prefix that equals them is kept plus one token, and
they are taken one by one (``take_token``), so finish checks, stop strings and jump-forward see each token
as without speculation; the pages past the next token are freed.

Faults stay with their request: an error while handling one request's output finishes it with a 500-coded
abort (``finish_with_error``); a batch whose sampling fails is sampled row by row so only the culprits fail.

Jump-forward may re-tokenise a request's latest output tokens. Only tokens not yet sent are ever dropped, so a
constrained request's last JUMP_FORWARD_HOLD tokens are held back from emission until they are final (or the
request finishes): the detokenizer only ever sees final tokens.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from radixrt.detokenize import TextStream
from radixrt.protocol.messages import BatchTokenOut, FinishReason, ReqDelta
from radixrt.scheduler.logits import collect_prompt_logprobs, next_token_ids_logprobs, next_tokens
from radixrt.scheduler.memory import Memory
from radixrt.scheduler.request import Req

if TYPE_CHECKING:
    from radixrt.constrained.grammar_backend import GrammarBackend
    from radixrt.scheduler.batch import Plan
    from radixrt.scheduler.speculation import Speculator

logger = logging.getLogger("radixrt.scheduler")
JUMP_FORWARD_HOLD = 4


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], vocab_size: int, context_length: int, page_size: int,
                 grammars: GrammarBackend | None, memory: Memory, sink: Callable[[BatchTokenOut], None]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.page_size = page_size
        self.grammars = grammars
        self.memory = memory
        self.sink = sink
        self.jump_forwards = 0
        self.jump_forward_tokens = 0  # output tokens jump-forward added, net
        self.speculator: Speculator | None = None  # set by the scheduler when speculative decoding is on
        self.weight_version: str | None = None  # the served weights' (scheduler/weights.py), on each last delta

    def process(self, plan: Plan, logits_rows: tuple[torch.Tensor, ...],
                hidden_rows: tuple[torch.Tensor, ...] | None = None) -> list[Req]:
        """Account for a forward's results (``hidden_rows``: the final norm's output at the same rows, when an
        embedding request's prompt ends in this batch); returns the requests that progressed, in plan order."""
        samplers: list[Req] = []
        last_rows: list[torch.Tensor] = []
        verifies: list[tuple[Req, torch.Tensor]] = []
        for i, ((req, n), rows) in enumerate(zip(plan, logits_rows)):
            if req.draft:
                verifies.append((req, rows))
                continue
            try:
                if self._advance(req, n, rows, hidden_rows[i] if hidden_rows is not None else None):
                    samplers.append(req)
                    last_rows.append(rows[-1])
            except Exception as exc:
                self.finish_with_error(req, exc, "reading its logits")
        if samplers:
            for req, token in zip(samplers, self._sample_each(samplers, last_rows)):
                if token is None:
                    continue
                try:
                    self.take_token(req, token)
                except Exception as exc:
                    self.finish_with_error(req, exc, "checking its output")
        if verifies:
            self._verify(verifies)
        return [req for req, _ in plan if req.num_computed == req.total_len - 1 or req.finished]

    def finish_with_error(self, req: Req, error: Exception, doing: str) -> None:
        """The runtime failed while serving this request: it ends with a 500-coded abort (once)."""
        if req.finished:
            return
        logger.error("request %s failed while %s: %r", req.rid, doing, error, exc_info=error)
        req.finish_reason = FinishReason.error(f"internal error while {doing}: {error!r}", 500)

    # ----- one request's tokens -----------------------------------------------------------------------

    def _advance(self, req: Req, n: int, rows: torch.Tensor, hidden: torch.Tensor | None = None) -> bool:
        """Account for ``n`` computed tokens of ``req``; True when its next token is to be sampled now."""
        start = req.num_computed
        if req.computes_prompt_logprobs:
            collect_prompt_logprobs(req, start, n, rows)
        if req.pools_every_token:
            req.pooling.add(start, hidden)
        req.num_computed += n
        if n > 1 and start < len(req.prompt_ids):  # a prefill chunk (not a jump-forward extend)
            self.memory.cache_prefix(req)
        if req.num_computed < req.total_len:
            return False  # a prefill chunk that does not reach the end yet
        if req.params.max_new_tokens == 0:  # prompt only: logprobs, prefilling a shared prefix, or an embedding
            if req.pooling is not None:
                req.embedding = req.pooling.vector(hidden[-1])
            if req.token_ids_logprob:
                next_token_ids_logprobs(req, rows[-1])
            req.finish_reason = FinishReason.length()
            return False
        return True

    def _sample_each(self, reqs: list[Req], rows: list[torch.Tensor]) -> list[int | None]:
        """Sample the batch at once; if that fails, one request at a time, so only the culprits fail."""
        try:
            return list(self._next_tokens(reqs, _stacked(rows)))
        except Exception as batch_error:
            logger.warning("sampling a batch of %d failed (%r); sampling its requests one by one", len(reqs),
                           batch_error)
        tokens: list[int | None] = []
        for req, row in zip(reqs, rows):
            try:
                tokens.append(self._next_tokens([req], row[None])[0])
            except Exception as exc:
                self.finish_with_error(req, exc, "sampling")
                tokens.append(None)
        return tokens

    def _next_tokens(self, reqs: list, logits: torch.Tensor) -> list[int]:
        return next_tokens(reqs, logits, self.eos_ids, self.vocab_size, self.grammars)

    # ----- speculative verify steps -------------------------------------------------------------------

    def _verify(self, verifies: list[tuple[Req, torch.Tensor]]) -> None:
        """The token of every verify row of every request at once; if that fails, one request at a time."""
        views = [self.speculator.rows(req) for req, _ in verifies]
        try:
            flat = [row for rows in views for row in rows]
            tokens = self._next_tokens(flat, _stacked([rows for _, rows in verifies]))
        except Exception as batch_error:
            logger.warning("verifying a batch of %d drafts failed (%r); verifying them one by one", len(verifies),
                           batch_error)
            tokens = None
        offset = 0
        for (req, logits), rows in zip(verifies, views):
            try:
                mine = self._next_tokens(rows, logits) if tokens is None else tokens[offset : offset + len(rows)]
                self._take_verified(req, mine, rows)
            except Exception as exc:
                self.finish_with_error(req, exc, "verifying its draft")
            offset += len(rows)

    def _take_verified(self, req: Req, tokens: list[int], rows: list) -> None:
        draft, start = req.draft, req.num_computed
        agreed = 0
        while agreed < len(draft) and tokens[agreed] == draft[agreed]:
            agreed += 1
        taken = 0
        jump_forwards = self.jump_forwards
        for j in range(agreed + 1):  # the agreed draft tokens, then the model's own
            req.num_computed = start + 1 + j  # the K/V of the last token and of the first j draft tokens
            if req.return_logprob:
                req.pending_output_logprobs.extend(rows[j].pending_output_logprobs)
                req.pending_output_top.extend(rows[j].pending_output_top)
                req.pending_output_token_ids.extend(rows[j].pending_output_token_ids)
            taken += 1
            self.take_token(req, tokens[j])
            if req.finished or self.jump_forwards != jump_forwards:  # done, or the grammar rewrote the tail
                break
        self.speculator.verified(req, agreed, taken)
        if not req.finished:
            self.memory.trim(req)

    def take_token(self, req: Req, token: int) -> None:
        """Append the sampled ``token``: finish checks, then jump-forward."""
        req.output_ids.append(token)
        self._check_finish(req, token)
        if not req.finished and req.grammar is not None:
            self._jump_forward(req)

    def _check_finish(self, req: Req, token: int) -> None:
        params = req.params
        if req.grammar is not None and not req.grammar.accept_token(token):
            req.finish_reason = FinishReason.error(f"constrained decoding: the grammar rejected token {token}", 500)
            return
        if token in (params.stop_token_ids or []) or (token in self.eos_ids and not params.ignore_eos):
            req.finish_reason = FinishReason.stop(token)
            return
        if req.stop_text is not None:
            req.stop_text.add([token])
            if req.stop_text.stopped_at is not None:
                req.finish_reason = FinishReason.stop(req.stop_text.stopped_at)
                return
        if req.grammar is not None and req.grammar.is_finished():
            req.finish_reason = FinishReason.stop()
            return
        outputs = len(req.output_ids)
        if outputs >= params.max_new_tokens or len(req.prompt_ids) + outputs >= self.context_length:
            req.finish_reason = FinishReason.length()

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
            req.stop_text = TextStream(self.tokenizer, req.params.stop, req.params.skip_special_tokens,
                                       stop_regex=req.params.stop_regex)
            req.stop_text.add(req.output_ids)
            if req.stop_text.stopped_at is not None:
                req.finish_reason = FinishReason.stop(req.stop_text.stopped_at)
                return
        if req.grammar.is_finished():
            req.finish_reason = FinishReason.stop()
        elif len(req.output_ids) >= req.params.max_new_tokens or req.total_len >= self.context_length:
            req.finish_reason = FinishReason.length()

    # ----- emission -----------------------------------------------------------------------------------

    def emit(self, reqs: list[Req]) -> None:
        """One ReqDelta per request (its new final tokens, logprobs, finish), all in one BatchTokenOut."""
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
            if req.spec is not None and req.spec.verify_steps:
                delta.spec_verify_ct = req.spec.verify_steps
                delta.spec_draft_tokens = req.spec.drafted
                delta.spec_accepted_tokens = req.spec.accepted
            if req.finish_reason is not None:
                delta.weight_version = self.weight_version
                if req.embedding is not None:
                    delta.embedding = req.embedding
            if req.num_sent == 0 and not req.input_logprobs_sent:
                delta.stop = req.params.stop
                delta.stop_regex = req.params.stop_regex
                delta.skip_special_tokens = req.params.skip_special_tokens
            if req.return_logprob:
                delta.output_logprobs, req.pending_output_logprobs = req.pending_output_logprobs, []
                if req.top_logprobs_num:
                    delta.output_top_logprobs, req.pending_output_top = req.pending_output_top, []
                if req.token_ids_logprob:
                    delta.output_token_ids_logprobs, req.pending_output_token_ids = req.pending_output_token_ids, []
                if not req.input_logprobs_sent and req.wants_prompt_logprobs:
                    delta.input_logprobs = list(req.input_logprobs)  # a copy: the request lives on
                    delta.input_top_logprobs = list(req.input_top_logprobs) if req.top_logprobs_num else None
                    if req.token_ids_logprob:
                        delta.input_token_ids_logprobs = list(req.input_token_ids_logprobs)
            req.input_logprobs_sent = True
            req.num_sent = end
            deltas.append(delta)
        if deltas:
            self.sink(BatchTokenOut(deltas))


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` of 1-D rows, or ``torch.cat`` of 2-D blocks of rows, without the copy where they already lie
    back to back in one tensor, as a forward's logits split by request do (a decode step's last rows, a verify
    step's blocks, in plan order): at batch 64 that saved copying 12 MB a step. next_tokens never writes into its
    input, so the view is safe."""
    blocks = [r if r.dim() == 2 else r[None] for r in rows]
    first = blocks[0]
    width, size = first.shape[1], first.element_size()
    storage, offset = first.untyped_storage().data_ptr(), first.data_ptr()
    count = 0
    for block in blocks:
        contiguous = block.stride(1) == 1 and (block.shape[0] == 1 or block.stride(0) == width)
        next_in_place = (block.untyped_storage().data_ptr() == storage
                         and block.data_ptr() == offset + count * width * size)
        if not (contiguous and block.shape[1] == width and block.dtype == first.dtype and next_in_place):
            return torch.cat(blocks)
        count += block.shape[0]
    return first.as_strided((count, width), (width, 1))
