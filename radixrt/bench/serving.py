"""`radixrt bench serving --url URL`: a workload against a running `radixrt serve`, like SGLang's bench_serving.

Requests go to the native ``/generate`` with ``stream: true`` and token ids (``input_ids``); each ``data:``
chunk carries the cumulative text and ``meta_info`` (completion and cached token counts); the stream ends with
``data: [DONE]``. Conversations run concurrently (at most ``max_concurrency``), turns of one conversation in
order, each re-sending the conversation so far with the server's own earlier output ids.

``url`` may be a sglang-router in front of several workers (it forwards ``/generate``). With ``worker_urls``
(the workers behind it, or the one server itself) ``run_serving_workers`` also reads each worker's ``/metrics``
before and after the run and returns what each served: requests, prompt tokens, cached tokens, hit rate.
"""

from __future__ import annotations

import asyncio
import json
import time

from radixrt.bench.report import RequestRecord, Summary, itl_from_chunks, summarize
from radixrt.bench.workers import WorkerStats, deltas_after, read_counters
from radixrt.bench.workloads import Workload, prompt_of


async def _one(client, ids: list[int], output_len: int, timeout: float) -> tuple[RequestRecord, list[int]]:
    import httpx

    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}}
    record = RequestRecord(prompt_tokens=len(ids), output_tokens=0)
    times: list[float] = []
    counts: list[int] = []
    output_ids: list[int] = []
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/generate", json=body, timeout=timeout) as res:
            if res.status_code != 200:
                record.error = f"HTTP {res.status_code}: {(await res.aread())[:200]!r}"
                return record, output_ids
            async for line in res.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                meta = chunk.get("meta_info", {})
                n = meta.get("completion_tokens", 0)
                if n and (not counts or n > counts[-1]):
                    times.append(time.perf_counter())
                    counts.append(n)
                record.output_tokens = n
                record.cached_tokens = meta.get("cached_tokens", 0)
                record.prompt_tokens = meta.get("prompt_tokens", record.prompt_tokens)
                if "output_ids" in chunk:
                    output_ids = list(chunk["output_ids"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = repr(exc)
    if times:
        record.ttft = times[0] - sent
        record.itls = itl_from_chunks(times, counts)
        record.latency = times[-1] - sent
    return record, output_ids


async def _run(url: str, workload: Workload, max_concurrency: int, timeout: float, progress: bool):
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    semaphore = asyncio.Semaphore(max_concurrency)
    records: list[RequestRecord] = []
    bar = tqdm(total=workload.num_requests, desc="serving", disable=not progress, leave=False)

    async def conversation(client, conv) -> None:
        outputs: list[list[int]] = []
        async with semaphore:
            for t, turn in enumerate(conv):
                record, out = await _one(client, prompt_of(conv, t, outputs), turn.output_len, timeout)
                records.append(record)
                bar.update(1)
                if record.error:
                    return
                outputs.append(out)

    async with httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits, timeout=timeout) as client:
        started = time.perf_counter()
        await asyncio.gather(*(conversation(client, c) for c in workload.conversations))
        seconds = time.perf_counter() - started
    bar.close()
    return records, seconds


def run_serving(url: str, workload: Workload, max_concurrency: int = 64, timeout: float = 600.0,
                progress: bool = True, label: str = "server") -> Summary:
    records, seconds = asyncio.run(_run(url, workload, max_concurrency, timeout, progress))
    return summarize(label, records, seconds)


def run_serving_workers(url: str, workload: Workload, worker_urls: list[str], max_concurrency: int = 64,
                        timeout: float = 600.0, progress: bool = True,
                        label: str = "server") -> tuple[Summary, list[WorkerStats]]:
    """``run_serving`` plus each worker's counters over the run (``worker_urls`` must be radixrt servers)."""
    before = [read_counters(u) for u in worker_urls]
    summary = run_serving(url, workload, max_concurrency, timeout, progress, label)
    finished = summary.requests - summary.failed
    return summary, deltas_after(before, finished)
