"""Batch generation without a scheduler: every prompt prefilled together, then decoded in lock step.

The thin layer that the demo and the model tests use; the scheduler (continuous batching, prefix cache)
drives the same pieces, ``ForwardBatch``, ``ModelRunner`` and the sampler, one step at a time.
"""

from __future__ import annotations

import torch

from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.runner import ModelRunner
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import SamplingBatch, sample


def _pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def generate_ids(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: set[int] = frozenset(),
) -> list[list[int]]:
    """Generate for all ``prompts`` at once; returns each prompt's new token ids."""
    pool, page_size = runner.pool, runner.page_size
    vocab = runner.config.vocab_size
    # each prompt draws from a seed of its own (one after the other from the given one, or from torch's generator)
    base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()))
    pages: list[list[int]] = [[] for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    lengths = [0] * len(prompts)  # tokens already in the cache
    pending = [list(p) for p in prompts]  # tokens to compute next
    active = list(range(len(prompts)))
    long_from = runner.long_rope_from  # LongRoPE: a sequence past it rotates long, computed again from the start
    long = [False] * len(prompts)
    try:
        while active and params.max_new_tokens > 0:
            for r in active:
                if long_from is not None and not long[r] and lengths[r] + len(pending[r]) > long_from:
                    long[r], lengths[r], pending[r] = True, 0, list(prompts[r]) + outputs[r]
                need = _pages_needed(lengths[r] + len(pending[r]), page_size) - len(pages[r])
                pages[r].extend(pool.alloc(need))
            batch = ForwardBatch.build(
                [SeqChunk(pending[r], lengths[r], pages[r], long_rope=long[r]) for r in active], page_size,
                runner.device, long_from)
            logits = runner.forward(batch)
            sampling = SamplingBatch.build([params] * len(active), vocab, [base + r for r in active],
                                           [len(outputs[r]) for r in active], device=runner.device)
            next_ids = sample(logits, sampling).tolist()
            still_active = []
            for r, token in zip(active, next_ids):
                lengths[r] += len(pending[r])
                outputs[r].append(token)
                pending[r] = [token]
                finished = len(outputs[r]) >= params.max_new_tokens or (
                    token in eos_ids and not params.ignore_eos and len(outputs[r]) >= params.min_new_tokens
                )
                if not finished:
                    still_active.append(r)
            active = still_active
    finally:
        for request_pages in pages:
            pool.decref(request_pages)
    return outputs
