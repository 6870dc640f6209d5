"""The tree workload: DSL programs (``import radixrt as sgl``) that fork into k branches at several depths.

Each program reads a document of about ``doc_words`` words, then at every depth forks every open branch
into ``branches`` and generates ``output_len`` tokens in each (tree-of-thought shape). A program makes
``branches + branches**2 + ... + branches**depth`` gen calls; every branch re-sends its ancestors' text, so
the prefix cache serves most of each prompt. Deterministic from the seed (greedy, ignore_eos).
"""

from __future__ import annotations

import random
import time

WORDS = ("apple river stone light cloud market engine garden paper silver window orange bridge forest "
         "number signal winter harbor letter planet music yellow castle pocket shadow thunder velvet").split()


def documents(num_programs: int, doc_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(doc_words)) for i in range(num_programs)]


def gen_calls(branches: int, depth: int) -> int:
    return sum(branches**d for d in range(1, depth + 1))


def make_program(branches: int, depth: int, output_len: int):
    import radixrt as sgl

    @sgl.function
    def tree(s, doc):
        s += doc + "\n"
        level = [s]
        for d in range(depth):
            nxt = []
            for state in level:
                forks = state.fork(branches)
                for i, f in enumerate(forks):
                    f += f"\nStep {d + 1}, idea {i + 1}:"
                    f += sgl.gen(f"t{d}", max_tokens=output_len, temperature=0.0, ignore_eos=True)
                    nxt.append(f)
            level = nxt
        for f in level:
            f.sync()

    return tree


def run_tree(engine, num_programs: int, branches: int, depth: int, output_len: int, doc_words: int, seed: int = 0,
             label: str = "radixrt tree"):
    """Run the programs through the engine backend; returns (summary, states)."""
    from radixrt.bench.offline import StepRecorder
    from radixrt.bench.report import summarize, RequestRecord
    from radixrt.frontend.backend.engine import EngineBackend

    program = make_program(branches, depth, output_len)
    backend = EngineBackend(engine)
    before = engine.get_stats()
    recorder = StepRecorder(engine.scheduler)
    started = time.perf_counter()
    try:
        states = program.run_batch([{"doc": d} for d in documents(num_programs, doc_words, seed)], backend=backend,
                                   num_threads=num_programs)
        seconds = time.perf_counter() - started
    finally:
        recorder.close()
    errors = [st.error() for st in states if st.error() is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} tree programs failed, first: {errors[0]!r}")
    after = engine.get_stats()
    hit = after["cache_hit_tokens"] - before["cache_hit_tokens"]
    miss = after["cache_miss_tokens"] - before["cache_miss_tokens"]
    calls = num_programs * gen_calls(branches, depth)
    # Token totals come from the scheduler's counters (the DSL hides per-call metadata from the caller).
    record = RequestRecord(prompt_tokens=hit + miss, output_tokens=calls * output_len, cached_tokens=hit)
    summary = summarize(label, [record], seconds, recorder.figures())
    summary.requests = calls
    return summary, states
