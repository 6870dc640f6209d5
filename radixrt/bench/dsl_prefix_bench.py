"""run_batch of few-shot DSL programs over one shared ~1,000-token header, on the default model:
throughput with the prefix hint + radix cache on, against both off.

Run: ``python -m radixrt.bench.dsl_prefix_bench`` (defaults: 64 programs, 8 new tokens each, greedy).

Modes (each on a fresh Engine in this process, the same programs):
* ``on``: radix cache on, run_batch's prefix hint on (the default behaviour): the header is prefilled once
  by the hint, every program finds it in the cache.
* ``cache-only``: radix cache on, hint off (``sgl.global_config.enable_precache_with_tracing = False``):
  programs admitted together before any of them has cached the header each compute it.
* ``off``: ``Engine(disable_radix_cache=True)`` and hint off: every program computes the whole header.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import radixrt as sgl

COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "Egypt", "Canada", "Brazil", "Kenya", "India",
             "Chile", "Norway", "Peru", "Greece", "Turkey", "Poland", "Cuba", "Iran", "Iraq", "Mexico"]
CAPITALS = ["Paris", "Berlin", "Rome", "Madrid", "Tokyo", "Cairo", "Ottawa", "Brasilia", "Nairobi", "New Delhi",
            "Santiago", "Oslo", "Lima", "Athens", "Ankara", "Warsaw", "Havana", "Tehran", "Baghdad", "Mexico City"]


def header(repeat: int = 3) -> str:
    lines = ["You answer questions about geography with one word.\n\n"]
    for _ in range(repeat):
        for country, capital in zip(COUNTRIES, CAPITALS):
            lines.append(f"Question: What is the capital city of {country}?\nAnswer: {capital}\n\n")
    return "".join(lines)


def make_program(text: str, max_tokens: int):
    @sgl.function
    def few_shot(s, question):
        s += text
        s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=max_tokens, stop="\n")

    return few_shot


def run_mode(mode: str, num: int, max_tokens: int, dtype: str) -> dict:
    engine = sgl.Engine(dtype=dtype, disable_radix_cache=(mode == "off"))
    try:
        text = header()
        program = make_program(text, max_tokens)
        args = [{"question": f"What is the capital city of country number {i}?"} for i in range(num)]
        sgl.global_config.enable_precache_with_tracing = mode == "on"
        program.run(question="warm-up", backend=engine, temperature=0)  # first-call costs out of the timing
        engine.flush_cache()
        before = engine.get_stats()
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        states = program.run_batch(args, backend=engine, temperature=0, ignore_eos=True)
        elapsed = time.perf_counter() - started
        after = engine.get_stats()
        metas = [s.get_meta_info("answer") for s in states]
        errors = [s.error() for s in states if s.error() is not None]
        if errors:
            raise errors[0]
        hit = after["cache_hit_tokens"] - before["cache_hit_tokens"]
        miss = after["cache_miss_tokens"] - before["cache_miss_tokens"]
        return {
            "mode": mode,
            "programs": num,
            "header_tokens": len(engine.tokenizer.encode(text)),
            "seconds": elapsed,
            "programs_per_s": num / elapsed,
            "output_tokens": sum(m["completion_tokens"] for m in metas),
            "prompt_tokens": sum(m["prompt_tokens"] for m in metas),
            "cached_tokens": sum(m["cached_tokens"] for m in metas),
            "computed_prompt_tokens": miss,
            "engine_hit_rate": hit / max(hit + miss, 1),
            "load": (load_before, os.getloadavg()[0]),
        }
    finally:
        sgl.global_config.enable_precache_with_tracing = True
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--modes", default="on,off", help="comma list of on, cache-only, off")
    args = parser.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    rows = [run_mode(m.strip(), args.num, args.max_tokens, args.dtype) for m in args.modes.split(",")]
    print(f"{args.num} programs, {rows[0]['header_tokens']}-token shared header, {args.max_tokens} new tokens "
          f"each (ignore_eos), dtype {args.dtype}")
    print("| mode | wall s | programs/s | output tok/s | prompt tokens computed | cached (meta info) | "
          "engine hit rate | load avg (start, end) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['seconds']:.1f} | {r['programs_per_s']:.2f} | "
              f"{r['output_tokens'] / r['seconds']:.1f} | {r['computed_prompt_tokens']:,} | "
              f"{r['cached_tokens']:,}/{r['prompt_tokens']:,} | {r['engine_hit_rate']:.1%} | "
              f"{r['load'][0]:.1f}, {r['load'][1]:.1f} |")
    if len(rows) > 1:
        print(f"speed-up of {rows[0]['mode']} over {rows[-1]['mode']}: "
              f"{rows[-1]['seconds'] / rows[0]['seconds']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
