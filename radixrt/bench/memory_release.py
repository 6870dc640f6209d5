"""What releasing the runtime's memory gives back, and what resuming it costs (SGLang's release / resume of memory
occupation, radixrt.scheduler.occupation), on an Engine whose scheduler runs in this process:

    python -m radixrt.bench.memory_release                      # the default model, float32
    python -m radixrt.bench.memory_release --dtype bfloat16 --kv-memory-gb 1

It fills the KV pool with one long prompt, then for each set of tags releases and resumes, and prints the process's
resident memory (VmRSS) before, released and resumed, the time of each call, and whether greedy tokens after the
resume equal those before. Ends with a ``RESULT_JSON`` line.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = ["The capital of Italy is Rome. The capital of Germany is Berlin. The capital of France is",
           "Once upon a time, there"]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
TAG_SETS = (None, ["kv_cache"], ["weights"])


def resident_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(engine, tags: list[str] | None, fill_tokens: int = 1500) -> dict:
    """Release and resume ``tags`` once on ``engine`` (its scheduler in this process), the pool filled first."""
    tokens = lambda: [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]  # noqa: E731
    before_tokens = tokens()
    engine.generate("word " * fill_tokens, {"max_new_tokens": 1})
    before = resident_mb()
    started = time.perf_counter()
    engine.release_memory_occupation(tags)
    release_s, released = time.perf_counter() - started, resident_mb()
    started = time.perf_counter()
    engine.resume_memory_occupation(tags)
    resume_s, resumed = time.perf_counter() - started, resident_mb()
    return {"tags": "all" if tags is None else "+".join(tags), "before_mb": round(before), "released_mb":
            round(released), "resumed_mb": round(resumed), "release_s": round(release_s, 3),
            "resume_s": round(resume_s, 3), "same_tokens": tokens() == before_tokens}


def main(argv: list[str] | None = None) -> None:
    import radixrt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-memory-gb", type=float, default=0.3)
    args = parser.parse_args(argv)
    kwargs = {"model_path": args.model_path} if args.model_path else {}
    rows = []
    with radixrt.Engine(dtype=args.dtype, kv_memory_gb=args.kv_memory_gb, log_interval=0,
                        engine_scheduler="thread", **kwargs) as engine:
        for tags in TAG_SETS:
            rows.append(measure(engine, tags))
    print("| tags | resident before, MB | released | resumed | release, s | resume, s | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['tags']} | {r['before_mb']} | {r['released_mb']} | {r['resumed_mb']} | {r['release_s']} | "
              f"{r['resume_s']} | {r['same_tokens']} |")
    print("RESULT_JSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
