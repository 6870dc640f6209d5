"""Overlap scheduling: decode step N+1 is launched before step N's tokens are read back, so the host's work for
a step (planning, reading tokens, finish checks, emitting) runs while the device computes the next one.

A :class:`Launched` step sampled its tokens on the device and is copying them into pinned host memory; the
scheduler holds at most one. Its requests' ``num_computed`` already counts the launched tokens, and each has
one sampled token in flight. The next step continues it when nothing else is due (``continuation``): every
request of the launched step decodes its in-flight token, which the forward reads from the device
(``continuation_batch``: the launched step's token tensor, gathered), with the pages it needs taken without
retracting anyone. Anything else (a request to admit, an abort, a flush, a control call, a request that needs
its previous token on the host, memory that runs short) settles the launched step first and runs the ordinary
synchronous step.

Only decode steps of simple requests are launched (``overlappable``): a grammar mask, penalties, a pending
``min_new_tokens`` ban or logprobs need the previous token on the host before sampling, so such a request keeps
the synchronous loop (and so does a batch that holds one); so does a request with a logit bias, which only the
synchronous sampler (radixrt.scheduler.logits) applies. A launched step's batch carries each request's LoRA
adapter as the synchronous one does.

A request that finishes when its step is read back (eos, a stop token or string) was already in the next
launched step, which writes its last token's K/V and samples one more token that is dropped. A request known
to end by length is left out of the next step instead. Its pages are released when it finishes, while the next
step may still write them: every later write or read of those pages (another request's forward, a page copy of
the radix cache) is issued after that step on the same device stream, so it runs after it; on a CPU the step
has already run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.model.forward_batch import ForwardBatch
from radixrt.sampling.sampler import SamplingBatch, sample
from radixrt.scheduler.page_rows import PageRows
from radixrt.scheduler.request import Req

Plan = list[tuple[Req, int]]


def overlappable(req: Req, in_flight: int = 0) -> bool:
    """Whether the request's next token can be sampled without its previous one on the host (``in_flight``:
    sampled tokens not yet in ``output_ids``)."""
    p = req.params
    return (not req.embed and p.max_new_tokens > 0 and req.grammar is None and req.grammar_future is None
            and not req.return_logprob
            and p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty
            and not p.logit_bias
            and len(req.output_ids) + in_flight >= p.min_new_tokens)


@dataclass
class Launched:
    """A decode step in flight: its plan, its tokens on the device, and their copy on the way to the host."""

    plan: Plan
    sampling: SamplingBatch  # its rows' sampling parameters, which a continuation of every row reuses
    tokens: torch.Tensor  # [B] on the device
    host: torch.Tensor  # [B] pinned (on a CPU: the tokens themselves)
    ready: torch.cuda.Event | None

    def token_ids(self) -> list[int]:
        """The sampled tokens, waiting for the copy if it is still running."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def holds(self, running: list[Req]) -> bool:
        """Whether ``running`` is the step's requests (in any order)."""
        if len(running) != len(self.plan):
            return False
        planned = {id(r) for r, _ in self.plan}
        return all(id(r) in planned for r in running)


def launch(plan: Plan, logits: torch.Tensor, vocab_size: int, in_flight: int = 0,
           sampling: SamplingBatch | None = None) -> Launched:
    """Sample the step's tokens on the device and start copying them to the host; the requests' ``num_computed``
    advance past the step's tokens now. ``in_flight``: sampled tokens of each request not yet in its
    ``output_ids`` (the index of the token drawn counts them); ``sampling``: the plan's rows' parameters, built
    here when not given."""
    if sampling is None:
        reqs = [req for req, _ in plan]
        sampling = SamplingBatch.build([r.params for r in reqs], vocab_size, [r.seed for r in reqs],
                                       [len(r.output_ids) + in_flight for r in reqs], device=logits.device)
    tokens = sample(logits, sampling)
    for req, n in plan:
        req.num_computed += n
    if tokens.device.type != "cuda":
        return Launched(plan, sampling, tokens, tokens, None)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return Launched(plan, sampling, tokens, host, ready)


def continued_sampling(plan: Plan, launched: Launched) -> SamplingBatch | None:
    """The launched step's sampling batch, each row drawing its next token, where ``plan`` (its continuation, a
    subsequence of its rows) keeps every row, in the same order; None (to be built) where rows were dropped."""
    return launched.sampling.advanced() if len(plan) == len(launched.plan) else None


def continuation(launched: Launched, context_length: int, long_rope_from: int | None = None) -> Plan | None:
    """The next decode step of the launched requests, each decoding its in-flight token, less those that end by
    length with it (they would only waste a row); None when a request outgrows a LongRoPE model's original context
    with it (``long_rope_from``: the synchronous step computes it again, rotated long).

    Every launched request was ``overlappable`` when its step was launched, and stays so: its parameters and
    grammar do not change, and its outputs with the one in flight only grow (``min_new_tokens``)."""
    plan = []
    for req, _ in launched.plan:
        if req.finish_reason is not None:
            continue
        if long_rope_from is not None and req.outgrows_short_rope(long_rope_from, in_flight=1):
            return None
        outputs = len(req.output_ids) + 1  # the in-flight token included
        if outputs < req.params.max_new_tokens and len(req.prompt_ids) + outputs < context_length:
            plan.append((req, 1))
    return plan


def continuation_batch(plan: Plan, launched: Launched, page_rows: PageRows, page_size: int, device: torch.device,
                       long_rope_from: int | None = None) -> ForwardBatch:
    """The forward batch of ``plan``: each request's token is its in-flight one, read on the device; its page table
    gathered from ``page_rows``."""
    row_of = {id(req): row for row, (req, _) in enumerate(launched.plan)}
    reqs = [req for req, _ in plan]
    # built with the launched rows in place of the tokens (one copy to the device), then gathered there
    batch = ForwardBatch.build_decode([row_of[id(req)] for req in reqs], [req.num_computed for req in reqs],
                                      page_rows.gather(reqs), page_size, device,
                                      [req.lora_uid for req in reqs], [req.long_rope for req in reqs],
                                      long_rope_from)
    batch.input_ids = launched.tokens[batch.input_ids]
    return batch
