"""What the runtime counts: latency histograms and the request counters of a client of the scheduler.

``Histogram`` is the one latency histogram: the client (``radixrt.client``) keeps time to first token,
inter-token latency, time per output token and end-to-end latency in ``RequestMetrics``, with the generation
throughput of the last ``THROUGHPUT_WINDOW_S`` seconds; the scheduler keeps its step latency (``STEP_BUCKETS``)
and reports it with its stats. ``radixrt.server.metrics`` renders both for /metrics. Imports nothing of the
runtime.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any

# Upper bounds (seconds) of the buckets: request latencies, and the scheduler's step latency.
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
THROUGHPUT_WINDOW_S = 10.0  # the generation throughput gauge counts the tokens of this many recent seconds


class Histogram:
    """Counts per bucket (the last one past every bound), the sum and the count of the observed values."""

    def __init__(self, buckets: list[float] = LATENCY_BUCKETS) -> None:
        self.buckets = list(buckets)
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, weight: int = 1) -> None:
        """``weight`` observations of ``value`` at once."""
        self.counts[bisect.bisect_left(self.buckets, value)] += weight
        self.sum += value * weight
        self.count += weight

    def cumulative(self) -> list[int]:
        """Prometheus's bucket counts: observations <= each bound (the +Inf bucket is ``count``)."""
        out, total = [], 0
        for c in self.counts[:-1]:
            total += c
            out.append(total)
        return out


class RequestMetrics:
    """Counters and latencies of the requests a client submitted (``observe_*`` take a ``radixrt.client.Handle``)."""

    def __init__(self) -> None:
        self.requests_received = 0
        self.requests_finished = 0
        self.requests_failed = 0  # refused (4xx) or failed (5xx)
        self.requests_aborted = 0
        self.requests_rejected = 0  # 503: queue full
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.tpot = Histogram()  # per request: (last token - first token) / (output tokens - 1)
        self.e2e = Histogram()
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the throughput window

    def observe_tokens(self, handle: Any, new_tokens: int, now: float) -> None:
        if not new_tokens:
            return
        self._recent.append((now, new_tokens))
        if handle.first_token_at is None:
            handle.first_token_at = now
            self.ttft.observe(now - handle.created)
            if new_tokens > 1:
                self.itl.observe(0.0, new_tokens - 1)
        else:
            self.itl.observe((now - handle.last_token_at) / new_tokens, new_tokens)
        handle.last_token_at = now

    def observe_finished(self, handle: Any, now: float) -> None:
        meta, reason = handle.builder.meta, handle.builder.finish_reason
        if handle.request_error() is not None or handle.server_error() is not None:
            self.requests_failed += 1
            return
        if reason is not None and reason.type == "abort":
            self.requests_aborted += 1
        self.requests_finished += 1
        self.prompt_tokens += meta.get("prompt_tokens", 0)
        self.generation_tokens += meta.get("completion_tokens", 0)
        self.cached_tokens += meta.get("cached_tokens", 0)
        self.e2e.observe(now - handle.created)
        outputs = meta.get("completion_tokens", 0)
        if outputs > 1 and handle.first_token_at is not None and handle.last_token_at is not None:
            self.tpot.observe((handle.last_token_at - handle.first_token_at) / (outputs - 1))

    def generation_throughput(self, now: float) -> float:
        """Output tokens per second over the last THROUGHPUT_WINDOW_S seconds."""
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S
