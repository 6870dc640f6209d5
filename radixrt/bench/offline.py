"""`radixrt bench offline`: a workload through the in-process Engine, streaming, one thread per conversation.

    radixrt bench offline --workload random --num-prompts 64 --input-len 200 --output-len 64 --baseline hf
    radixrt bench offline --workload shared-prefix --prefix-len 1000 --question-len 30 --compare-no-cache
    radixrt bench offline --workload sharegpt --turns 3 --num-prompts 32 --json out.json

Every request is greedy with ignore_eos, so output lengths are fixed by the workload. Each run prints a
summary table (runs side by side, the first one is the reference of the ratio row); the engine's own figures
come from a recorder around the scheduler step: peak KV pages, KV waste (allocated-but-unused slots /
allocated, over the pages that running requests hold), and the scheduler's share of a decode step.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixrt.bench.report import RequestRecord, Summary, itl_from_chunks, kv_waste, percentile, summarize
from radixrt.bench.workloads import Workload, prompt_of


class StepRecorder:
    """Wraps a scheduler's step (on the scheduler thread) to record per-step figures without a cross-thread call."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[dict[str, Any]] = []
        self._batch: tuple[bool, int] = (False, 0)
        self._orig_step = scheduler.step
        self._orig_forward = scheduler.runner.forward
        scheduler.step = self._step
        scheduler.runner.forward = self._forward

    def close(self) -> None:
        self.scheduler.step = self._orig_step
        self.scheduler.runner.forward = self._orig_forward

    def reset(self) -> None:
        self.steps = []

    def _forward(self, batch):
        self._batch = (batch.is_decode, batch.batch_size)
        return self._orig_forward(batch)

    def _step(self) -> bool:
        self._batch = (False, 0)
        before = self.scheduler.steps
        did = self._orig_step()
        if self.scheduler.steps != before:
            s = self.scheduler
            allocated, used, pages = self._kv_usage()
            self.steps.append({
                "decode": self._batch[0], "batch": self._batch[1], "seconds": s.last_step_seconds,
                "forward": s.forward_seconds, "pages": pages, "allocated": allocated, "used": used,
            })
        return did

    def _kv_usage(self) -> tuple[int, int, int]:
        """(allocated slots, used slots, pages) over the distinct pages that running requests hold."""
        ps = self.scheduler.page_size
        tree: set[int] = set()
        private_pages = private_used = 0
        for req in self.scheduler.running:
            tree.update(req.pages[: req.num_tree_pages])
            private = len(req.pages) - req.num_tree_pages
            private_pages += private
            private_used += min(max(req.num_computed - req.num_tree_pages * ps, 0), private * ps)
        pages = len(tree) + private_pages
        return pages * ps, len(tree) * ps + private_used, pages

    def figures(self) -> dict[str, Any]:
        steps = self.steps
        if not steps:
            return {}
        out: dict[str, Any] = {"steps": len(steps), "peak KV pages": max(s["pages"] for s in steps)}
        allocated = sum(s["allocated"] for s in steps)
        used = sum(s["used"] for s in steps)
        out["KV waste % (all steps)"] = 100 * kv_waste(allocated, used)
        peak = max(steps, key=lambda s: s["allocated"])
        out["KV waste % (at peak)"] = 100 * kv_waste(peak["allocated"], peak["used"])
        decode = [s for s in steps if s["decode"]]
        if decode:
            top = max(s["batch"] for s in decode)
            at_top = [s for s in decode if s["batch"] == top]
            out["max decode batch"] = top
            out["decode step ms p50"] = 1000 * percentile([s["seconds"] for s in at_top], 50)
            out["sched overhead % p50"] = 100 * percentile(
                [(s["seconds"] - s["forward"]) / s["seconds"] for s in at_top if s["seconds"] > 0], 50)
            out["decode tok/s (steps)"] = sum(s["batch"] for s in decode) / max(sum(s["seconds"] for s in decode), 1e-9)
        return out


def _params(output_len: int) -> dict[str, Any]:
    return {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}


def run_workload(engine, workload: Workload, label: str = "radixrt", progress: bool = True,
                 max_concurrency: int | None = None) -> tuple[Summary, list[list[list[int]]]]:
    """Run ``workload`` on ``engine``; returns the summary and each conversation's outputs, turn by turn."""
    from tqdm import tqdm

    recorder = StepRecorder(engine.scheduler)
    bar = tqdm(total=workload.num_requests, desc=label, disable=not progress, leave=False)
    lock = threading.Lock()
    records: list[RequestRecord] = []
    outputs: list[list[list[int]]] = [[] for _ in workload.conversations]

    def one_conversation(index: int) -> None:
        conv = workload.conversations[index]
        for t, turn in enumerate(conv):
            ids = prompt_of(conv, t, outputs[index])
            record = RequestRecord(prompt_tokens=len(ids), output_tokens=0)
            times: list[float] = []
            counts: list[int] = []
            sent = time.perf_counter()
            last: dict = {}
            try:
                for chunk in engine.generate(input_ids=ids, sampling_params=_params(turn.output_len), stream=True):
                    n = chunk["meta_info"]["completion_tokens"]
                    if n and (not counts or n > counts[-1]):
                        times.append(time.perf_counter())
                        counts.append(n)
                    last = chunk
            except Exception as exc:  # a failed request is counted, not fatal
                record.error = repr(exc)
            if last:
                meta = last["meta_info"]
                record.output_tokens = meta["completion_tokens"]
                record.cached_tokens = meta["cached_tokens"]
                outputs[index].append(list(last["output_ids"]))
            else:
                outputs[index].append([])
            if times:
                record.ttft = times[0] - sent
                record.itls = itl_from_chunks(times, counts)
                record.latency = times[-1] - sent
            with lock:
                records.append(record)
                bar.update(1)
            if record.error:
                break

    workers = max_concurrency or len(workload.conversations)
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:
            list(pool.map(one_conversation, range(len(workload.conversations))))
        seconds = time.perf_counter() - started
    finally:
        recorder.close()
        bar.close()
    return summarize(label, records, seconds, recorder.figures()), outputs


def warm_up(engine) -> None:
    """One short request, so one-time costs (first kernels, allocator) stay out of the timed run."""
    engine.generate(input_ids=[[1000 + i for i in range(40)], [2000 + i for i in range(40)]],
                    sampling_params=_params(4))
    engine.flush_cache()
