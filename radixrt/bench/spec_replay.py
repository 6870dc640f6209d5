"""Speculation's own drafting policy replayed offline over recorded outputs: a chain of drafts against a tree of
candidates, at a draft token's cost.

    python -m radixrt.bench.spec_replay [--workloads extraction,agent] [--seeds 3] [--token-costs 0.02,0.12]
                                        [--widths 1,2,3] [--history cold|warm] [--max-new-tokens 128] [--dtype auto]

Records each workload's greedy outputs at batch 1 as ``spec_ceiling`` does, then drafts over them step by step as
the Speculator does (``radixrt.scheduler.speculation``: its suffix matches, its acceptance estimates per class of
evidence, its draft length for a token cost ``c``), without knowing how far a draft will be right. A step that
drafts costs ``1 + c * n`` decode steps for ``n`` drafted tokens and gives the tokens its draft agrees with, plus
one; the figure is output tokens per unit of cost, the decode speed-up the policy gives at that cost (the steps'
other costs, and drafts from the radix cache, left out).

Width ``w`` > 1 verifies a tree: the chain, plus up to ``w - 1`` other candidates (``drafts.candidates``: every
earlier occurrence's continuation, the longest agreement first), each cut to the chain's length and kept where it
is not already a path of the tree. Its tokens are the tree's nodes, each costing ``c``; it gives its deepest
path that agrees with the output. Where the tree does not beat the chain at the cost a verify row has on the
machine (``radixrt bench spec`` reports it), the Speculator's chain is what pays. The last column drafts the chain
with lengths from the evidence class's estimate alone, without weighing each token by the earlier occurrences
that agree with it (``drafts.support``): what that weighing adds.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from radixrt.bench.spec_ceiling import (MAX_DRAFT, MAX_WINDOW, MIN_WINDOW, Request, agreement, collect, parse_replay,
                                        replay_arguments)
from radixrt.scheduler.drafts import ContextIndex, History, candidates, ngram_match, support
from radixrt.scheduler.speculation import SpecState, evidence_class


def tree_of(chain: list[int], others: Sequence[list[int]], width: int) -> list[list[int]]:
    """The chain, then up to ``width - 1`` of ``others`` cut to its length, each one that is not already a path
    from the root of those taken (a prefix of one)."""
    branches = [chain]
    for other in others:
        if len(branches) >= width:
            break
        cut = other[: len(chain)]
        if cut and not any(branch[: len(cut)] == cut for branch in branches):
            branches.append(cut)
    return branches


def nodes(branches: Sequence[Sequence[int]]) -> int:
    """Tokens of the tree the branches make (their shared prefixes counted once)."""
    return len({tuple(branch[: i + 1]) for branch in branches for i in range(len(branch))})


def replay(request: Request, earlier: list[Request], cost: float, width: int, weigh: bool = True) -> dict:
    """The request's output drafted step by step with ``width`` branches at ``cost`` a token: tokens per unit of
    cost, steps, tokens drafted (tree nodes) and accepted. ``weigh=False``: draft lengths from the evidence
    class's estimate alone, without the earlier occurrences' support token by token."""
    history = History(1 << 22, MIN_WINDOW, MAX_WINDOW)
    for r in earlier:
        history.add(r.prompt + r.output)
    state = SpecState(ContextIndex(MIN_WINDOW, MAX_WINDOW))
    output = request.output
    spent, steps, drafted, accepted, j = 0.0, 0, 0, 0, 0
    while j < len(output):
        tokens = request.prompt + output[:j]
        state.index.sync(tokens, len(tokens))
        ngrams_pay = state.ngrams_pay(MAX_DRAFT, cost)
        match = ngram_match(state.index, history, tokens, MAX_DRAFT) if ngrams_pay else None
        wanted = match is not None and (weigh or width > 1)  # the occurrences weigh the chain or branch the tree
        found = candidates(state.index, history, tokens, MAX_DRAFT) if wanted else []
        weights = support(match.tokens[:MAX_DRAFT], found) if match is not None and weigh else None
        length = state.draft_length(match, MAX_DRAFT, cost, weights=weights) if match is not None else 0
        steps += 1
        if length == 0:
            if not ngrams_pay:
                state.relax()
            spent, j = spent + 1.0, j + 1
            continue
        chain = match.tokens[:length]
        others = [m.tokens for m in found] if width > 1 else []
        branches = tree_of(chain, others, width)
        agreed = max(agreement(branch, output, j) for branch in branches)
        state.observe(evidence_class(match.length), agreed, agreed < length)
        size = nodes(branches)
        drafted += size
        accepted += agreed
        spent += 1.0 + cost * size
        j += agreed + 1
    return dict(speedup=len(output) / spent if spent else 1.0, steps=steps, drafted=drafted, accepted=accepted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    replay_arguments(parser, [0.02, 0.12])
    parser.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    args = parse_replay(parser, argv)
    if min(args.widths) < 1:
        parser.error("widths must be >= 1")
    columns = [("chain" if w == 1 else f"tree of {w}", w, True) for w in args.widths]
    columns.append(("chain, class estimate only", 1, False))
    head = "| workload | draft token cost | " + " | ".join(label for label, _, _ in columns) + " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in args.workloads:
        seeds = list(range(-1 if args.history == "warm" else 0, args.seeds))
        runs = collect(name, seeds, args.max_new_tokens, args.dtype)
        for c in args.token_costs:
            cells = []
            for _, width, weigh in columns:
                gains = []
                for seed in range(args.seeds):
                    earlier = [r for s in seeds if s < seed for r in runs[s]] if args.history == "warm" else []
                    for i, request in enumerate(runs[seed]):
                        gains.append(replay(request, earlier + runs[seed][:i], c, width, weigh)["speedup"])
                cells.append(f"{sum(gains) / len(gains):.2f}")
            print(f"| {name} | {c:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
