"""Quickstart: a radixrt DSL program on the default model (what `make demo` runs).

A program is a Python function over a state `s`: append chat roles and text, `gen` fills a variable
from the model, `select` picks one of several strings by the model's logprobs, `fork` continues one
state in parallel branches that share its prefix in the radix cache.

    python examples/quickstart.py                              # in-process engine (radixrt.Engine)
    python examples/quickstart.py --url http://127.0.0.1:30000 # a running `radixrt serve`
"""

from __future__ import annotations

import argparse
import time

import radixrt as sgl


@sgl.function
def city_guide(s, city):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user(f"What is {city} famous for?")
    s += sgl.assistant(sgl.gen("famous", max_tokens=16, stop="\n"))
    s += sgl.user(f"Which continent is {city} in?")
    s += sgl.assistant(sgl.select("continent", choices=["Europe", "Asia", "Africa", "America"]))
    # Two branches continue from the same conversation; its tokens are computed once.
    forks = s.fork(2)
    for f, topic in zip(forks, ["food", "landmark"]):
        f += sgl.user(f"Name one famous {topic} of {city}.")
        f += sgl.assistant(sgl.gen("tip", max_tokens=12, stop="\n"))
    forks.join()  # s["tip"] is now the list of both branches' answers
    return forks


def cache_hit_rate(metas) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) summed over the gens' meta info."""
    metas = [m for m in metas if m and "prompt_tokens" in m]
    return sum(m.get("cached_tokens", 0) for m in metas), sum(m["prompt_tokens"] for m in metas)


def main(backend=None):
    backend = backend or sgl.get_default_backend()
    engine = getattr(backend, "engine", None)  # the in-process engine, when that is the backend
    before = engine.get_stats() if engine is not None else None
    started = time.perf_counter()
    states = city_guide.run_batch([{"city": "Paris"}, {"city": "Tokyo"}], backend=backend, temperature=0)
    elapsed = time.perf_counter() - started
    metas = []
    for state in states:
        if state.error() is not None:
            raise state.error()
        print(f"### {state['famous']!r}")
        print(f"    continent: {state['continent']}")
        print(f"    tips: {state['tip']}")
        metas += [state.get_meta_info("famous")] + [f.get_meta_info("tip") for f in state.ret_value]
    cached, prompt = cache_hit_rate(metas)
    print(f"\n{len(states)} programs in {elapsed:.1f}s; prompt tokens served from the prefix cache "
          f"(gens' meta info): {cached}/{prompt} = {cached / max(prompt, 1):.0%}")
    if engine is not None:
        after = engine.get_stats()
        hit = after["cache_hit_tokens"] - before["cache_hit_tokens"]
        miss = after["cache_miss_tokens"] - before["cache_miss_tokens"]
        print(f"engine stats, every request (hints and select scoring included): {hit}/{hit + miss} "
              f"= {hit / max(hit + miss, 1):.0%} of prompt tokens hit the cache")
    return states


def backend_from_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running `radixrt serve`, e.g. http://127.0.0.1:30000 "
                        "(default: load the default model in process)")
    args = parser.parse_args(argv)
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine()


if __name__ == "__main__":
    sgl.set_default_backend(backend_from_args())
    main()
