"""Per-request records, the summary every bench prints, and the math behind it (percentiles, KV waste)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    ttft: float | None = None  # seconds from send to the first output token
    itls: list[float] = field(default_factory=list)  # seconds between successive output tokens
    latency: float = 0.0  # seconds from send to the last token
    error: str | None = None


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method); nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    if len(s) == 1:
        return float(s[0])
    rank = (len(s) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(s) - 1)
    return float(s[low] + (s[high] - s[low]) * (rank - low))


def kv_waste(allocated_slots: int, used_slots: int) -> float:
    """Share of allocated KV slots that hold no token: (allocated - used) / allocated (0 when nothing is)."""
    if allocated_slots <= 0:
        return 0.0
    if used_slots > allocated_slots:
        raise ValueError(f"{used_slots} used slots of only {allocated_slots} allocated")
    return (allocated_slots - used_slots) / allocated_slots


def itl_from_chunks(times: list[float], counts: list[int]) -> list[float]:
    """Inter-token gaps from stream chunks: ``times[i]`` is when chunk i arrived holding ``counts[i]`` tokens in
    total so far. A chunk that brings k tokens after a gap g counts as k gaps of g/k."""
    gaps: list[float] = []
    for i in range(1, len(times)):
        k = counts[i] - counts[i - 1]
        if k > 0:
            gaps += [(times[i] - times[i - 1]) / k] * k
    return gaps


@dataclass
class Summary:
    label: str
    requests: int
    failed: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    seconds: float
    output_tok_s: float
    total_tok_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    latency_s: dict[str, float]
    cache_hit_rate: float  # cached prompt tokens / prompt tokens
    extra: dict[str, Any] = field(default_factory=dict)  # engine stats: peak KV pages, KV waste, step overhead

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pcts(values: list[float], scale: float = 1.0) -> dict[str, float]:
    return {f"p{p}": percentile(values, p) * scale for p in (50, 90, 99)}


def summarize(label: str, records: list[RequestRecord], seconds: float, extra: dict | None = None) -> Summary:
    ok = [r for r in records if r.error is None]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    seconds = max(seconds, 1e-9)
    return Summary(
        label=label,
        requests=len(records),
        failed=len(records) - len(ok),
        input_tokens=inp,
        output_tokens=out,
        cached_tokens=cached,
        seconds=seconds,
        output_tok_s=out / seconds,
        total_tok_s=(inp + out) / seconds,
        ttft_ms=_pcts([r.ttft for r in ok if r.ttft is not None], 1000.0),
        itl_ms=_pcts([g for r in ok for g in r.itls], 1000.0),
        latency_s=_pcts([r.latency for r in ok]),
        cache_hit_rate=cached / inp if inp else 0.0,
        extra=dict(extra or {}),
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(summaries: list[Summary]) -> str:
    """One column per run (side by side), one row per figure."""
    rows: list[tuple[str, list[str]]] = [
        ("requests (failed)", [f"{s.requests} ({s.failed})" for s in summaries]),
        ("input tokens", [str(s.input_tokens) for s in summaries]),
        ("output tokens", [str(s.output_tokens) for s in summaries]),
        ("cached tokens", [str(s.cached_tokens) for s in summaries]),
        ("total time (s)", [_fmt(s.seconds) for s in summaries]),
        ("output tok/s", [_fmt(s.output_tok_s) for s in summaries]),
        ("total tok/s", [_fmt(s.total_tok_s) for s in summaries]),
    ]
    for name, key in (("TTFT ms", "ttft_ms"), ("ITL ms", "itl_ms")):
        for p in ("p50", "p90", "p99"):
            rows.append((f"{name} {p}", [_fmt(getattr(s, key)[p]) for s in summaries]))
    rows.append(("cache hit rate", [f"{100 * s.cache_hit_rate:.1f}%" for s in summaries]))
    keys: list[str] = []
    for s in summaries:
        keys += [k for k in s.extra if k not in keys]
    for k in keys:
        rows.append((k, [_fmt(s.extra[k]) if k in s.extra else "" for s in summaries]))
    base = summaries[0].output_tok_s if summaries else 0.0
    if len(summaries) > 1 and base > 0:
        rows.append((f"output tok/s vs {summaries[0].label}",
                     [f"{s.output_tok_s / base:.2f}x" for s in summaries]))
    headers = ["", *[s.label for s in summaries]]
    width0 = max(len(r[0]) for r in rows + [(headers[0], [])])
    widths = [max(len(headers[i + 1]), *(len(r[1][i]) for r in rows)) for i in range(len(summaries))]
    lines = [" | ".join([headers[0].ljust(width0), *(h.rjust(w) for h, w in zip(headers[1:], widths))])]
    lines.append("-+-".join(["-" * width0, *("-" * w for w in widths)]))
    for name, cells in rows:
        lines.append(" | ".join([name.ljust(width0), *(c.rjust(w) for c, w in zip(cells, widths))]))
    return "\n".join(lines)


def write_json(path: str, summaries: list[Summary], context: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"context": context or {}, "runs": [s.to_dict() for s in summaries]}, f, indent=2, default=str)
