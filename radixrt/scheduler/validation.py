"""Request limits shared by the scheduler and the HTTP process (no torch: the server's tokenizer side imports it)."""

from __future__ import annotations

import math

from radixrt.sampling.params import SamplingParams


class RequestError(ValueError):
    """A request the runtime cannot serve (a 4xx for the HTTP server)."""


def validate_request(input_ids: list[int], params: SamplingParams, *, vocab_size: int, context_length: int,
                     page_size: int, num_pages: int) -> None:
    """Raise RequestError for a request that can never be served."""
    if not input_ids:
        raise RequestError("the prompt is empty")
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input_ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    total = len(input_ids) + params.max_new_tokens
    if total > context_length:
        raise RequestError(
            f"the prompt ({len(input_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds "
            f"the context length ({context_length})"
        )
    pages = math.ceil(total / page_size) + 1
    if pages > num_pages:
        raise RequestError(f"the prompt plus max_new_tokens needs {pages} KV pages; the pool has {num_pages}")
