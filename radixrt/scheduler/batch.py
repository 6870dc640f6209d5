"""Batch building: which tokens of which running requests the next forward computes, and its ForwardBatch.

A plan lists ``(request, n)``: the forward computes the next ``n`` tokens of ``req.fill_ids`` (from
``req.num_computed`` on). A decode computes one token; a prefill chunk more, within the chunked-prefill token
budget, in admission order. The logits of a chunk's last token give the request's next token; prompt
logprobs need the rows from their first position on. A decode with a speculative draft (``req.draft``,
radixrt.scheduler.speculation) computes its last token and the draft, ``(req, 1 + len(draft))``, and needs
every row. A batch that ends an embedding request's prompt keeps the hidden states of its logits rows too
(``ForwardBatch.return_hidden``); an embedding pooled over every token needs every row of each of its chunks. A
batch with LoRA requests is ordered by adapter, so each adapter's rows are one range (radixrt.model.lora_batch).
"""

from __future__ import annotations

import torch

from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.scheduler.page_rows import PageRows
from radixrt.scheduler.request import Req

Plan = list[tuple[Req, int]]


def plan_batch(running: list[Req], chunked_prefill_size: int, enable_mixed_chunk: bool) -> Plan:
    """Prefills share the chunked-prefill token budget in admission order. While any prefill runs, decodes
    wait (prefill first, as SGLang does: the fewest steps for a batch of prompts) unless
    ``enable_mixed_chunk`` rides them along in the same step (steadier inter-token latency)."""
    budget = chunked_prefill_size
    plan: Plan = []
    has_prefill = False
    for req in running:
        todo = req.num_to_compute
        if todo == 1:
            plan.append((req, 1))
        elif budget > 0:
            n = min(todo, budget)
            budget -= n
            plan.append((req, n))
            has_prefill = True
    if has_prefill and not enable_mixed_chunk:
        plan = [(req, n) for req, n in plan if req.num_to_compute > 1]
    if any(req.lora_uid for req, _ in plan):  # each LoRA adapter's rows together: slices, not gathers
        plan.sort(key=lambda item: item[0].lora_uid)
    return plan


def logits_from(req: Req, n: int) -> int:
    """First row of this chunk whose logits are needed (prompt logprobs start early, a verify needs all, an embedding
    pooled over every token needs every row's hidden state)."""
    if req.draft or req.pools_every_token:
        return 0
    if req.computes_prompt_logprobs:
        first_position = max(req.logprob_start_len - 1, 0)
        if first_position < req.num_computed + n:
            return max(first_position - req.num_computed, 0)
    return n - 1


def build_forward_batch(plan: Plan, page_rows: PageRows, page_size: int, device: torch.device | str,
                        long_rope_from: int | None = None) -> ForwardBatch:
    """The forward's metadata; every planned request's pages must already cover its new tokens (its page table
    gathered from ``page_rows``). ``long_rope_from``: a LongRoPE model's original context
    (``ModelRunner.long_rope_from``)."""
    chunks = [SeqChunk(_tokens(req, n), req.num_computed, req.pages, logits_from(req, n), req.lora_uid,
                       req.long_rope) for req, n in plan]
    batch = ForwardBatch.build(chunks, page_size, device, long_rope_from, page_rows.gather([req for req, _ in plan]))
    batch.return_hidden = any(req.pools_every_token or (req.embed and req.num_computed + n == req.total_len)
                              for req, n in plan)
    return batch


def _tokens(req: Req, n: int) -> list[int]:
    if req.draft:
        return req.tokens_between(req.num_computed, req.total_len) + req.draft
    return req.tokens_between(req.num_computed, req.num_computed + n)
