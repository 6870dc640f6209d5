"""What a forward's logits become: next tokens (penalties, logit bias, min-token bans, grammar masks, sampling) and
logprobs.

``next_tokens`` samples a batch of requests at once (a constrained request closes its match when its budget
runs out: ``close_within_budget``) and appends output logprobs to each request's pending ones; it never writes
into the logits it is given (it processes a copy where a request needs processing), so they may be views;
``collect_prompt_logprobs`` reads the prompt logprob rows of one prefill chunk; ``next_token_ids_logprobs`` a
prompt-only request's requested ids after its prompt. Neither finishes a request:
an error propagates to the caller, which decides whom it fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixrt.constrained.grammar import CLOSING_HORIZON
from radixrt.sampling.logits_processor import (
    apply_logit_bias,
    apply_penalties,
    ban_tokens,
    ids_logprobs,
    penalised,
    token_logprobs,
)
from radixrt.sampling.sampler import SamplingBatch, sample
from radixrt.scheduler.request import Req

if TYPE_CHECKING:
    from radixrt.constrained.grammar_backend import GrammarBackend


def next_tokens(reqs: list[Req], logits: torch.Tensor, eos_ids: set[int], vocab_size: int,
                grammars: GrammarBackend | None) -> list[int]:
    """One next token per row of ``logits`` (one row per request, or per ``DraftRow`` of a verify step: the
    request as it would be after that row's draft tokens, drawing for the output index after them); logprobs of
    the raw logits."""
    params = [r.params for r in reqs]
    raw = logits
    banned = []
    for r in reqs:
        ids: list[int] = []
        if len(r.output_ids) < r.params.min_new_tokens:
            ids = sorted((set() if r.params.ignore_eos else eos_ids) | set(r.params.stop_token_ids or []))
        banned.append(ids)
    if any(banned) or any(_processed(r) for r in reqs):  # the caller's logits stay as they are (views welcome)
        logits = logits.clone()
    apply_penalties(logits, params, [r.prompt_ids for r in reqs], [r.output_ids for r in reqs])
    apply_logit_bias(logits, params)
    ban_tokens(logits, banned)
    if any(r.grammar is not None for r in reqs):
        grammars.apply_masks(logits, [r.grammar for r in reqs])
        close_within_budget(logits, reqs)
    batch = SamplingBatch.build(params, vocab_size, [r.seed for r in reqs], [len(r.output_ids) for r in reqs],
                                device=logits.device)
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
            if reqs[i].token_ids_logprob:
                reqs[i].pending_output_token_ids.extend(ids_logprobs(logprobs[j : j + 1], reqs[i].token_ids_logprob))
    return token_ids


def _processed(req: Req) -> bool:
    """Whether ``next_tokens`` writes into this request's row (penalties, logit bias, a grammar's mask)."""
    return req.grammar is not None or bool(req.params.logit_bias) or penalised(req.params)


def close_within_budget(logits: torch.Tensor, reqs: list[Req]) -> None:
    """A constrained request whose token budget is down to the shortest way to a match writes that way, so
    its output matches when the budget ends (a JSON string that would run past max_new_tokens is closed); in a
    matching state it may not begin what it could not finish (a tool call, a structure, late in its budget)."""
    for i, r in enumerate(reqs):
        budget = r.params.max_new_tokens - len(r.output_ids)
        if r.grammar is None or budget > CLOSING_HORIZON:
            continue
        token = r.grammar.closing_token(budget)
        if token is not None:
            logits[i].fill_(float("-inf"))
            logits[i, token] = 0.0
            continue
        banned = r.grammar.out_of_reach(budget)
        if banned:
            logits[i, torch.tensor(banned, device=logits.device)] = float("-inf")


def collect_prompt_logprobs(req: Req, start: int, n: int, rows: torch.Tensor) -> None:
    """Row i of ``rows`` holds the logits after position ``start + n - len(rows) + i``."""
    first_row_position = start + n - rows.shape[0]
    prompt_len = len(req.prompt_ids)
    if req.logprob_start_len == 0 and not req.input_logprobs and start == 0:
        req.input_logprobs.append((None, req.prompt_ids[0]))
        if req.top_logprobs_num:
            req.input_top_logprobs.append([])
        if req.token_ids_logprob:
            req.input_token_ids_logprobs.append([])
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
    if req.token_ids_logprob:
        req.input_token_ids_logprobs.extend(ids_logprobs(logprobs, req.token_ids_logprob))


def next_token_ids_logprobs(req: Req, last_row: torch.Tensor) -> None:
    """A prompt-only request's ``token_ids_logprob`` at the position after its prompt (what SGLang's scoring reads:
    the next token's distribution, nothing sampled)."""
    logprobs = torch.log_softmax(last_row[None].float(), dim=-1)
    req.pending_output_token_ids.extend(ids_logprobs(logprobs, req.token_ids_logprob))
