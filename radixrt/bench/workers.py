"""Per-worker prefix-cache stats of a serving run: each `radixrt serve` read before and after the run.

Contract:
- ``router_workers(url)`` asks a sglang-router for its workers (``GET /workers``, then ``GET /list_workers``);
  it returns [] when ``url`` is not a router (a plain radixrt server has neither route).
- ``read_counters(url)`` reads a worker's ``GET /metrics`` (Prometheus text) and returns its finished
  requests, prompt tokens and cached prompt tokens (the HTTP process's counters of finished requests).
- ``WorkerStats`` is the difference of two readings of one worker; ``format_workers`` prints one row per
  worker and a total row, with the cache hit rate (cached prompt tokens / prompt tokens).
Nothing here changes a worker; reading ``/metrics`` is all it does.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

COUNTERS = {"requests": "sglang:num_requests_total", "prompt_tokens": "sglang:prompt_tokens_total",
            "cached_tokens": "sglang:cached_tokens_total"}


@dataclass
class WorkerStats:
    url: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def minus(self, before: "WorkerStats") -> "WorkerStats":
        return WorkerStats(self.url, self.requests - before.requests, self.prompt_tokens - before.prompt_tokens,
                           self.cached_tokens - before.cached_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": round(self.hit_rate, 6)}


def parse_prometheus(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition: name -> value. A server serves one model, so its
    ``model_name`` label is dropped; other labels stay in the name (``x_bucket{le="0.5"}``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[_without_model_name(name.strip())] = float(value)
        except ValueError:
            continue
    return out


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _without_model_name(sample: str) -> str:
    name, brace, labels = sample.partition("{")
    if not brace:
        return sample
    kept = [f'{key}="{value}"' for key, value in _LABEL.findall(labels) if key != "model_name"]
    return f"{name}{{{','.join(kept)}}}" if kept else name


def read_counters(url: str, timeout: float = 30.0) -> WorkerStats:
    import httpx

    res = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout)
    res.raise_for_status()
    samples = parse_prometheus(res.text)
    missing = [m for m in COUNTERS.values() if m not in samples]
    if missing:
        raise ValueError(f"{url}/metrics lacks {missing}: is it a radixrt server?")
    return WorkerStats(url, **{k: int(samples[m]) for k, m in COUNTERS.items()})


def _urls(data: Any) -> list[str]:
    """Worker URLs in a router's listing: {"urls": [...]}, {"workers": [{"url": ...}, ...]} or a bare list."""
    if isinstance(data, dict):
        for key in ("urls", "workers", "worker_urls"):
            if key in data:
                return _urls(data[key])
        return []
    if isinstance(data, list):
        out: list[str] = []
        for item in data:
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, dict) and isinstance(item.get("url"), str):
                out.append(item["url"])
        return out
    return []


def router_workers(url: str, timeout: float = 10.0) -> list[str]:
    import httpx

    for path in ("/workers", "/list_workers"):
        try:
            res = httpx.get(url.rstrip("/") + path, timeout=timeout)
        except httpx.HTTPError:
            continue
        if res.status_code == 200:
            try:
                urls = _urls(res.json())
            except ValueError:
                continue
            if urls:
                return urls
    return []


def total(stats: list[WorkerStats]) -> WorkerStats:
    return WorkerStats("total", sum(s.requests for s in stats), sum(s.prompt_tokens for s in stats),
                       sum(s.cached_tokens for s in stats))


def format_workers(stats: list[WorkerStats]) -> str:
    rows = [*stats, total(stats)]
    width = max(len(s.url) for s in rows)
    lines = [f"{'worker':<{width}} | requests | prompt tokens | cached tokens | hit rate"]
    for s in rows:
        lines.append(f"{s.url:<{width}} | {s.requests:>8} | {s.prompt_tokens:>13} | {s.cached_tokens:>13} | "
                     f"{s.hit_rate:>8.3f}")
    return "\n".join(lines)


def deltas_after(before: list[WorkerStats], expected_requests: int, wait: float = 5.0) -> list[WorkerStats]:
    """Each worker's counters since ``before``. A worker counts a request a moment after its stream ends, so
    this reads again (up to ``wait`` seconds) until the workers together count ``expected_requests``."""
    import time

    deadline = time.monotonic() + wait
    while True:
        now = [read_counters(b.url).minus(b) for b in before]
        if total(now).requests >= expected_requests or time.monotonic() >= deadline:
            return now
        time.sleep(0.1)
