"""Soak the scheduler: simulate many seeds (``radixrt.bench.sim``) and summarise; exit 1 on any failure.

    python -m radixrt.bench.soak --seeds 1000                 # seeds 0..999, knobs drawn from each seed
    python -m radixrt.bench.soak --seeds 200 --start 5000 --steps-per-seed 50000
    python -m radixrt.bench.soak --repro '{"seed": 17, "num_requests": 3, ...}'   # one failing case again

A seed fails when the scheduler crashes (an exception out of ``step()``, or a request ended with a server
error), an invariant breaks, KV reads back wrong, pages leak, a request never finishes (within
``--steps-per-seed`` steps), its deltas disagree with its output, or its output differs from the same
request run alone. Each failing seed is shrunk (fewer requests, features off, simpler options, keeping the
same kind of failure) and printed with the knobs that reproduce it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields

import torch

from radixrt.bench.sim import Knobs, SeedResult, SoloOracle, load_world, run_seed

MAX_SHRINK_RUNS = 80


def _simplifications(knobs: Knobs):
    """Candidate knobs one step simpler than ``knobs``, most promising first."""
    n = knobs.num_requests
    for smaller in sorted({1, n // 4, n // 2, n - 1}):
        if 1 <= smaller < n:
            yield knobs.replace(num_requests=smaller)
    for name in ("constrained", "aborts", "logprobs", "n_samples", "multi_turn", "stops", "sampled", "flushes",
                 "enable_mixed_chunk", "jump_forward", "partial_page_reuse"):
        if getattr(knobs, name):
            yield knobs.replace(**{name: False})
    simpler = {"arrival_span": 0, "schedule_policy": "fcfs", "chunked_prefill_size": 2048,
               "max_running_requests": 64, "oversubscription": 1.0}
    for name, value in simpler.items():
        if getattr(knobs, name) != value:
            yield knobs.replace(**{name: value})
    for value in (4, 8, 16):
        if value < knobs.max_new_tokens:
            yield knobs.replace(max_new_tokens=value)


def shrink(result: SeedResult, run, budget: int = MAX_SHRINK_RUNS) -> SeedResult:
    """The simplest knobs found (greedily) that still fail with ``result``'s first kind of failure."""
    kind = result.failures[0][0]
    best, runs, improved = result, 0, True
    while improved and runs < budget:
        improved = False
        for candidate in _simplifications(best.knobs):
            runs += 1
            tried = run(candidate)
            if tried.failures and tried.failures[0][0] == kind:
                best, improved = tried, True
                break
            if runs >= budget:
                break
    return best


def _parse_overrides(items: list[str]) -> dict:
    types = {f.name: f.type for f in fields(Knobs)}
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"unknown knob {name!r}; knobs: {', '.join(types)}")
        kind = types[name]
        out[name] = (value.lower() in ("1", "true", "yes")) if kind == "bool" else \
            int(value) if kind == "int" else float(value) if kind == "float" else value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixrt.bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--steps-per-seed", type=int, default=20_000,
                        help="scheduler steps after which a seed that is not idle counts as hung")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                        help="pin a knob in every seed (e.g. page_size=1); repeatable")
    parser.add_argument("--repro", default=None, help="run one knobs JSON (as printed for a failure) and exit")
    parser.add_argument("--no-shrink", action="store_true", help="report failing seeds without shrinking them")
    parser.add_argument("--verbose", action="store_true", help="one line per seed")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # many tiny tensor ops: threads only add overhead
    world = load_world()
    oracle = SoloOracle(world)

    def run(knobs: Knobs) -> SeedResult:
        return run_seed(knobs, world, oracle, max_steps=args.steps_per_seed)

    if args.repro is not None:
        result = run(Knobs.from_json(args.repro))
        print("ok" if result.ok else "\n".join(f"{kind}: {message}" for kind, message in result.failures))
        return 0 if result.ok else 1

    overrides = _parse_overrides(args.knob)
    totals = dict(steps=0, busy_steps=0, tokens=0, requests=0, aborts=0, retractions=0, preemptions=0,
                  evicted_pages=0, pages_leaked=0, jump_forwards=0, session_turns=0, long_rope_restarts=0,
                  embeddings=0, token_id_logprobs=0, weight_updates=0)
    failed: list[SeedResult] = []
    started = time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        result = run(Knobs.from_seed(seed, **overrides))
        for name in totals:
            totals[name] += getattr(result, name)
        if args.verbose:
            print(f"seed {seed}: {'ok' if result.ok else result.failures[0][0]}, {result.steps} steps, "
                  f"{result.requests} requests, {result.retractions} retractions, {result.seconds:.2f} s", flush=True)
        if not result.ok:
            failed.append(result)
    seconds = time.perf_counter() - started

    crashes = sum(1 for r in failed if r.crashed)
    print(f"seeds {args.seeds} (from {args.start}), {len(failed)} failed, {crashes} crashed")
    print(f"steps {totals['steps']} ({totals['busy_steps']} with a forward, {totals['tokens']} tokens) in "
          f"{seconds:.1f} s: {totals['steps'] / max(seconds, 1e-9):.0f} steps/s (solo reference runs included)")
    print(f"requests {totals['requests']}, aborted {totals['aborts']}, retractions {totals['retractions']}, "
          f"preemptions {totals['preemptions']}, "
          f"evicted pages {totals['evicted_pages']}, jump-forwards {totals['jump_forwards']}, "
          f"session turns {totals['session_turns']}, long-rope restarts {totals['long_rope_restarts']}, "
          f"embeddings {totals['embeddings']}, token-id logprob requests {totals['token_id_logprobs']}, "
          f"weight updates {totals['weight_updates']}, "
          f"pages leaked {totals['pages_leaked']}")
    for result in failed:
        kind, message = result.failures[0]
        print(f"\nFAILED seed {result.knobs.seed}: {kind}: {message}")
        if not args.no_shrink:
            small = shrink(result, run)
            print(f"  minimal ({small.knobs.num_requests} requests): {kind}: {small.failures[0][1]}")
            result = small
        print(f"  repro: python -m radixrt.bench.soak --repro '{result.knobs.to_json()}'")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
