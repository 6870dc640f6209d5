"""What the scheduler reports: its ``SchedulerStats`` (control calls, ``/metrics``, benchmarks) and the periodic
progress line in the log. Reads the scheduler's parts; changes nothing."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixrt.protocol.messages import SchedulerStats

if TYPE_CHECKING:
    from radixrt.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixrt.scheduler.scheduler")


def collect_stats(sched: Scheduler) -> SchedulerStats:
    s = sched.cache.stats
    spec = sched.speculator
    return SchedulerStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        pages_total=sched.pool.num_pages,
        pages_free=sched.pool.num_free,
        pages_evictable=sched.cache.evictable_pages,
        pages_protected=sched.cache.protected_pages,
        pages_private=sum(len(r.pages) - r.num_tree_pages for r in sched.running),
        cache_hit_tokens=sched.admission.hit_tokens,
        cache_miss_tokens=sched.admission.miss_tokens,
        partial_tokens_reused=s.partial_tokens_reused,
        evicted_pages=s.evicted_pages,
        num_retractions=sched.num_retractions,
        num_preemptions=sched.admission.num_preemptions,
        num_long_rope_restarts=sched.admission.num_long_rope_restarts,
        last_step_seconds=sched.last_step_seconds,
        steps=sched.steps,
        jump_forwards=sched.output.jump_forwards,
        jump_forward_tokens=sched.output.jump_forward_tokens,
        sessions_open=len(sched.sessions.table),
        pages_pinned=sched.sessions.pinned_pages,
        decode_seconds=sched.decode_seconds,
        decode_tokens=sched.decode_tokens,
        decode_steps=sched.decode_steps,
        decode_requests=sched.decode_requests,
        spec_verify_steps=spec.verify_steps if spec is not None else 0,
        spec_draft_tokens=spec.drafted if spec is not None else 0,
        spec_accepted_tokens=spec.accepted if spec is not None else 0,
    )


def log_progress(sched: Scheduler, tokens_per_second: float) -> None:
    """One INFO line of the scheduler's state (and one of speculative decoding's acceptance, when it drafts)."""
    s = collect_stats(sched)
    hit = s.cache_hit_tokens / max(s.cache_hit_tokens + s.cache_miss_tokens, 1)
    logger.info(
        "step %d: running %d, waiting %d, %.1f tok/s, pages used %d/%d (evictable %d), cache hit %.1f%%, "
        "retractions %d, preemptions %d", s.steps, s.num_running, s.num_waiting, tokens_per_second,
        s.pages_total - s.pages_free, s.pages_total, s.pages_evictable, 100 * hit, s.num_retractions,
        s.num_preemptions,
    )
    if sched.speculator is not None and s.spec_verify_steps:
        logger.info("speculative decoding: accept length %.2f, %d of %d draft tokens accepted (%.1f%%)",
                    sched.speculator.accept_length, s.spec_accepted_tokens, s.spec_draft_tokens,
                    100 * s.spec_accepted_tokens / max(s.spec_draft_tokens, 1))
