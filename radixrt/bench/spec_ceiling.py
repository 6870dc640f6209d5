"""What speculation could give at best on the spec bench's workloads: their greedy outputs replayed offline.

    python -m radixrt.bench.spec_ceiling [--workloads extraction,agent] [--seeds 3] [--token-costs 0.05,0.35]
                                         [--history cold|warm] [--max-new-tokens 128] [--dtype auto]

Runs each workload (``radixrt.bench.spec_workloads``) at batch 1 without speculation, seed by seed, and keeps
every request's prompt and output. Then replays each output: at a state with ``j`` output tokens a step drafts
``k`` tokens, costs ``1 + c * k`` decode steps and gives the draft's agreeing prefix plus one token. ``c`` is a
draft token's cost against a request's share of a decode step (``verify_step_bench`` measures it: about 0.05 at
batch 1 and 0.35 at batch 8 on 2 cores). Each drafter drafts exactly as far as it will be right, an oracle no
real one has, so its tokens per unit of cost bound the decode speed-up it can give:

- ``drafter``: radixrt's own proposal (``radixrt.scheduler.drafts``: the longest suffix match in the request's
  context, or in the history of earlier requests where that matches longer);
- ``any match``: the best continuation among every earlier occurrence of the request's latest token, in its
  context or the history: what a perfect choice among all n-gram candidates (a tree of them) could give.

``--history cold``: the history holds the earlier requests of the same run (seed), as ``radixrt bench spec
--history cold``; ``warm``: also every earlier run's (the warm-up's, seed -1, and earlier seeds').
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from radixrt.bench.spec_workloads import WORKLOADS, run_workload
from radixrt.scheduler.drafts import ContextIndex, History, ngram_match
from radixrt.server_args import ServerArgs

MAX_DRAFT = 8
MIN_WINDOW = ServerArgs.speculative_ngram_min_match_window_size  # the server's defaults for n-gram matches
MAX_WINDOW = ServerArgs.speculative_ngram_max_match_window_size


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output: list[int]


def agreement(proposal: list[int], output: list[int], j: int) -> int:
    """How many of ``proposal``'s tokens equal the output from position ``j`` on."""
    n = 0
    while n < len(proposal) and j + n < len(output) and proposal[n] == output[j + n]:
        n += 1
    return n


def drafter_agreement(index: ContextIndex, history: History, tokens: list[int], output: list[int], j: int) -> int:
    match = ngram_match(index, history, tokens, MAX_DRAFT)
    return agreement(match.tokens, output, j) if match is not None else 0


def any_match_agreement(sources: list[np.ndarray], tokens: np.ndarray, output: list[int], j: int) -> int:
    """The longest agreement of the continuation after any earlier occurrence of the latest token."""
    best = 0
    for source in sources:
        own = source is tokens
        ends = np.flatnonzero(source[: len(source) - 1 if own else len(source)] == tokens[-1]) + 1
        for end in ends[ends < len(source)]:
            best = max(best, agreement(source[end : end + MAX_DRAFT].tolist(), output, j))
            if best == MAX_DRAFT:
                return best
    return best


def replay(request: Request, earlier: list[Request], costs: list[float]) -> dict[str, list[float]]:
    """Tokens per unit of cost for each drafter and each cost (the decode speed-up it bounds)."""
    history = History(1 << 22, MIN_WINDOW, MAX_WINDOW)
    for r in earlier:
        history.add(r.prompt + r.output)
    sources = [np.asarray(r.prompt + r.output) for r in earlier]
    out = {}
    for name in ("drafter", "any match"):
        spent = [0.0] * len(costs)
        index = ContextIndex(MIN_WINDOW, MAX_WINDOW)
        j = 0
        while j < len(request.output):
            tokens = request.prompt + request.output[:j]
            if name == "drafter":
                index.sync(tokens, len(tokens))
                k = drafter_agreement(index, history, tokens, request.output, j)
            else:
                array = np.asarray(tokens)
                k = any_match_agreement([array, *sources], array, request.output, j)
            for i, c in enumerate(costs):
                spent[i] += 1.0 + c * k
            j += k + 1
        out[name] = [len(request.output) / s for s in spent]
    return out


def collect(name: str, seeds: list[int], max_new_tokens: int, dtype: str) -> dict[int, list[Request]]:
    """Each seed's requests, in order, run at batch 1 without speculation."""
    import radixrt
    from radixrt.bench.spec_bench import engine_calls
    from radixrt.server_args import DEFAULT_MODEL

    engine = radixrt.Engine(model=DEFAULT_MODEL, dtype=dtype, log_interval=0)
    try:
        generate, chat = engine_calls(engine)
        runs: dict[int, list[Request]] = {}
        for seed in seeds:
            requests: list[Request] = []

            def recording(prompts, params, requests=requests):
                outs = generate(prompts, params)
                requests.extend(Request(engine.tokenizer.encode(p), ids) for p, (ids, _) in zip(prompts, outs))
                return outs

            run_workload(name, recording, chat, 1, max_new_tokens, seed)
            runs[seed] = requests
        return runs
    finally:
        engine.shutdown()


def replay_arguments(parser: argparse.ArgumentParser, token_costs: list[float]) -> None:
    """The options of an offline replay over recorded workload outputs (this module's and ``spec_replay``'s)."""
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=["extraction", "agent"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--token-costs", type=lambda s: [float(x) for x in s.split(",")], default=token_costs)
    parser.add_argument("--history", choices=("cold", "warm"), default="cold")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")


def parse_replay(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The options parsed and the workloads checked; the run's settings printed."""
    args = parser.parse_args(argv)
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    print(f"history {args.history}, {args.seeds} seeds, {args.max_new_tokens} tokens, draft <= {MAX_DRAFT}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    replay_arguments(parser, [0.05, 0.35])
    args = parse_replay(parser, argv)
    print("| workload | draft token cost | drafter, as far as right | any match, as far as right |")
    print("|---|---:|---:|---:|")
    for name in args.workloads:
        seeds = list(range(-1 if args.history == "warm" else 0, args.seeds))
        runs = collect(name, seeds, args.max_new_tokens, args.dtype)
        gains: dict[str, list[list[float]]] = {"drafter": [], "any match": []}
        for seed in range(args.seeds):
            earlier = [r for s in seeds if s < seed for r in runs[s]] if args.history == "warm" else []
            for i, request in enumerate(runs[seed]):
                for drafter, per_cost in replay(request, earlier + runs[seed][:i], args.token_costs).items():
                    gains[drafter].append(per_cost)
        for i, c in enumerate(args.token_costs):
            mean = {d: sum(g[i] for g in rows) / len(rows) for d, rows in gains.items()}
            print(f"| {name} | {c:g} | {mean['drafter']:.2f} | {mean['any match']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
