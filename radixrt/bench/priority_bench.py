"""`radixrt bench priority`: interactive requests next to a batch job, priority preemption on and off.

    radixrt bench priority --batch 16 --batch-input 200 --batch-output 128 --interactive 6 --interval 1.5

Batch requests (priority 0, greedy, ignore_eos) fill every running slot; interactive requests (priority 20)
then arrive one every ``--interval`` seconds. Each configuration runs in a fresh in-process Engine: preemption
on (the default), then ``--disable-priority-preemption``. Reported per configuration: the interactive
requests' time to first token and latency (median and worst), when the batch job finished, the preemptions,
and whether every request's tokens equal those of the other configuration (preemption must not change them).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Any

URGENT = 20


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def run_config(args: argparse.Namespace, preemption: bool) -> dict[str, Any]:
    from radixrt.engine import Engine

    rng = random.Random(args.seed)
    engine = Engine(dtype=args.dtype, log_interval=0, max_running_requests=args.max_running_requests,
                    disable_priority_preemption=not preemption, engine_scheduler="thread")
    vocab = engine.scheduler.vocab_size
    batch = [_ids(rng, args.batch_input, vocab) for _ in range(args.batch)]
    interactive = [_ids(rng, args.interactive_input, vocab) for _ in range(args.interactive)]
    outputs: dict[str, list[int]] = {}
    ttft: dict[str, float] = {}
    done: dict[str, float] = {}
    started = time.perf_counter()

    def one(name: str, ids: list[int], max_new: int, priority: int) -> None:
        submitted = time.perf_counter()
        params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        for chunk in engine.generate(input_ids=ids, sampling_params=params, priority=priority, stream=True):
            if chunk["output_ids"] and name not in ttft:
                ttft[name] = time.perf_counter() - submitted
            outputs[name] = chunk["output_ids"]
        done[name] = time.perf_counter() - (started if priority == 0 else submitted)

    try:
        threads = [threading.Thread(target=one, args=(f"b{i}", ids, args.batch_output, 0))
                   for i, ids in enumerate(batch)]
        for t in threads:
            t.start()
        while len(engine.scheduler.running) < min(args.max_running_requests, args.batch):  # the slots are full
            time.sleep(0.01)
        for i, ids in enumerate(interactive):
            t = threading.Thread(target=one, args=(f"i{i}", ids, args.interactive_output, URGENT))
            t.start()
            threads.append(t)
            time.sleep(args.interval)
        for t in threads:
            t.join()
        preemptions = engine.scheduler.stats().num_preemptions
    finally:
        engine.shutdown()
    names = [f"i{i}" for i in range(args.interactive)]
    first = sorted(ttft[n] for n in names)
    latency = sorted(done[n] for n in names)
    return {"preemption": preemption, "interactive_ttft_median_s": round(first[len(first) // 2], 2),
            "interactive_ttft_max_s": round(first[-1], 2), "interactive_latency_median_s":
            round(latency[len(latency) // 2], 2), "interactive_latency_max_s": round(latency[-1], 2),
            "batch_done_s": round(max(done[f"b{i}"] for i in range(args.batch)), 2), "preemptions": preemptions,
            "interactive_ttft_s": [round(ttft[n], 2) for n in names], "outputs": outputs}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=16, help="batch requests (priority 0)")
    p.add_argument("--batch-input", type=int, default=200)
    p.add_argument("--batch-output", type=int, default=128)
    p.add_argument("--interactive", type=int, default=6, help=f"interactive requests (priority {URGENT})")
    p.add_argument("--interactive-input", type=int, default=64)
    p.add_argument("--interactive-output", type=int, default=16)
    p.add_argument("--interval", type=float, default=1.5, help="seconds between interactive arrivals")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")


def run(args: argparse.Namespace) -> int:
    from radixrt.bench.commands import machine

    print(" ".join(f"{k}={v}" for k, v in machine().items()), flush=True)
    results = [run_config(args, preemption) for preemption in (True, False)]
    same = results[0]["outputs"] == results[1]["outputs"]
    print(f"{'preemption':>10} | {'TTFT p50 / max (s)':>18} | {'latency p50 / max (s)':>21} | "
          f"{'batch done (s)':>14} | preemptions")
    for r in results:
        print(f"{'on' if r['preemption'] else 'off':>10} | {r['interactive_ttft_median_s']:>8} / "
              f"{r['interactive_ttft_max_s']:<7} | {r['interactive_latency_median_s']:>10} / "
              f"{r['interactive_latency_max_s']:<8} | {r['batch_done_s']:>14} | {r['preemptions']}")
    print(f"every request's tokens equal in both runs: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if not callable(v)}, "same_outputs": same,
                       "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results]}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="radixrt bench priority", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
