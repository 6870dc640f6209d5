"""Runs of the scheduler over a model whose outputs are compared to the last bit (test_batch_invariance.py,
test_deterministic.py): each request's tokens with their logprobs and top-5 logprobs, which come from the logits'
exact bits, so a change in rounding shows there even where it flips no token."""

from __future__ import annotations

from radixrt.protocol.messages import BatchTokenOut, GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.server_args import ServerArgs

PAGE = 16


def logprob_runs(folder, dtype: str, groups: list[list[tuple[list[int], SamplingParams]]], *,
                 deterministic: bool = False, chunk: int = 2048, speculative: bool = False,
                 cached: list[int] | None = None, page_size: int = PAGE, overlap: bool = False,
                 logprobs: bool = True, stats: dict | None = None) -> tuple[list[list], int]:
    """Each request of ``groups`` as its (token, logprob, top-5 logprobs) triples, in order, and how many draft
    tokens were accepted. The requests of a group are submitted together, and a group runs to the end before the
    next is submitted; first, on its own, ``cached`` (a prompt whose pages the radix cache then holds).
    ``overlap``: through the overlap scheduler, which only runs requests without logprobs: ``logprobs=False``
    leaves them out (each triple's logprobs None). ``stats`` gets the scheduler's ``launched_steps`` and its final ``SchedulerStats`` (``scheduler``)."""
    from radixrt.model.runner import ModelRunner
    from radixrt.scheduler.scheduler import Scheduler

    out: dict[str, list] = {}

    def sink(msg: BatchTokenOut) -> None:
        for delta in msg.deltas:
            if delta.rid != "cached" and not logprobs:
                out.setdefault(delta.rid, []).extend((token, None, None) for token in delta.new_ids)
            elif delta.rid != "cached":
                out.setdefault(delta.rid, []).extend(zip(delta.new_ids, delta.output_logprobs or [],
                                                         delta.output_top_logprobs or [], strict=True))

    runner = ModelRunner(folder, dtype=dtype, page_size=page_size, num_pages=128 * PAGE // page_size,
                         deterministic=deterministic)
    args = ServerArgs(log_interval=0, page_size=page_size, chunked_prefill_size=chunk, debug_checks=True,
                      speculative_algorithm="NGRAM" if speculative else None, enable_overlap_schedule=overlap)
    scheduler = Scheduler(args, runner, None, {0}, sink)

    def drain() -> None:
        while scheduler.step() or not scheduler.idle:
            pass

    if cached is not None:
        scheduler.submit(GenerateReq("cached", cached, SamplingParams(max_new_tokens=1, ignore_eos=True)))
        drain()
    rids = []
    for group in groups:
        for ids, params in group:
            rids.append(f"r{len(rids)}")
            scheduler.submit(GenerateReq(rids[-1], ids, params, return_logprob=logprobs,
                                         top_logprobs_num=5 if logprobs else 0))
        drain()
    accepted = scheduler.speculator.accepted if speculative else 0
    if stats is not None:
        stats["launched_steps"] = scheduler.launched_steps
        stats["scheduler"] = scheduler.stats()
    return [out[rid] for rid in rids], accepted
