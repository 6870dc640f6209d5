"""Few-shot question answering over a batch: every program starts with the same few-shot header.

`run_batch` traces the program, finds the constant header and prefills it once (a prefix hint); the
radix cache then serves it to every program, so only each question's own tokens are computed.

    python examples/few_shot_qa.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import time

import radixrt as sgl

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Egypt?", "Cairo"),
]
HEADER = "Answer each question with one word.\n\n" + "".join(f"Q: {q}\nA: {a}\n\n" for q, a in EXAMPLES)

QUESTIONS = [
    "What is the capital of England?",
    "What is the capital of Russia?",
    "What is the capital of Greece?",
    "What is the capital of China?",
]


@sgl.function
def few_shot_qa(s, question):
    s += HEADER
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", max_tokens=6, stop="\n")


def main(backend=None, questions=QUESTIONS):
    backend = backend or sgl.get_default_backend()
    started = time.perf_counter()
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend, temperature=0)
    elapsed = time.perf_counter() - started
    cached = prompt = 0
    for q, state in zip(questions, states):
        if state.error() is not None:
            raise state.error()
        meta = state.get_meta_info("answer")
        cached += meta.get("cached_tokens", 0)
        prompt += meta.get("prompt_tokens", 0)
        print(f"{q:40s} -> {state['answer'].strip()!r}  ({meta.get('cached_tokens')}/{meta.get('prompt_tokens')} "
              "prompt tokens cached)")
    print(f"\n{len(states)} programs in {elapsed:.1f}s; {cached}/{prompt} = {cached / max(prompt, 1):.0%} of the "
          "programs' prompt tokens came from the prefix cache")
    return states


def backend_from_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running `radixrt serve` (default: the in-process engine)")
    args = parser.parse_args(argv)
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine()


if __name__ == "__main__":
    sgl.set_default_backend(backend_from_args())
    main()
