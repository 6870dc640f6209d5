"""Tree of thought with nested forks: the question branches into a few approaches, each approach
into a few answers, and the model judges every leaf with `select`. Branches at one level decode
together in one batch, and every branch finds its parent's text in the radix cache.

    python examples/tree_of_thought.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import radixrt as sgl

APPROACHES = ["Think step by step.", "Use a simple example."]


@sgl.function
def tree_of_thought(s, question, answers_per_approach=2):
    s += sgl.user(question)
    s += sgl.assistant_begin()
    approaches = s.fork(len(APPROACHES))
    for branch, hint in zip(approaches, APPROACHES):
        branch += hint + " First," + sgl.gen("plan", max_tokens=10, min_tokens=2, stop="\n", temperature=0.8)
    # Level by level, so that the branches of one level run (and batch) together.
    leaves = [branch.fork(answers_per_approach) for branch in approaches]
    for group in leaves:
        for leaf in group:
            leaf += "\nSo the answer is" + sgl.gen("answer", max_tokens=8, min_tokens=2, stop="\n", temperature=0.8)
            leaf += sgl.assistant_end()
            leaf += sgl.user("Is that answer right?")
            leaf += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))
    for group in leaves:
        group.join()  # branch["answer"], branch["verdict"]: lists over that approach's leaves
    approaches.join()  # s["plan"], s["answer"], s["verdict"]: lists over the approaches
    return approaches


def main(backend=None, question="Why is the sky blue?"):
    backend = backend or sgl.get_default_backend()
    state = tree_of_thought.run(question=question, backend=backend)
    if state.error() is not None:
        raise state.error()
    print(f"Q: {question}")
    for hint, plan, answers, verdicts in zip(APPROACHES, state["plan"], state["answer"], state["verdict"]):
        print(f"- {hint} First,{plan}")
        for answer, verdict in zip(answers, verdicts):
            print(f"    - So the answer is{answer}   [judged right: {verdict}]")
    return state


def backend_from_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running `radixrt serve` (default: the in-process engine)")
    args = parser.parse_args(argv)
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine()


if __name__ == "__main__":
    sgl.set_default_backend(backend_from_args())
    main()
