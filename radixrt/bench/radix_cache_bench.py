"""Micro-benchmark of the radix prefix cache: match and insert cost with many long cached sequences.

Run: ``python -m radixrt.bench.radix_cache_bench`` (defaults: 10k sequences x 1k tokens, page sizes 1 and 16).

Two seeded workloads:
* ``shared``: realistic sharing. 64 "system prompts" (100..400 tokens), 8 few-shot blocks each
  (100..300 tokens), then a unique user part up to the full length: a tree with a few hundred
  branch points and one leaf per sequence.
* ``random``: fully random sequences (every sequence branches at the root).

Each sequence is cached the way the scheduler does it (match, allocate the rest, insert, drop
duplicates). Then it times, per call: match of a cached sequence (full hit), match of an unseen
sequence (the shared workload shares its prefix; the random one misses), insert of an already cached
sequence (all pages duplicate), and lock+unlock of a deep node. The baseline, measured in the same
run, is a hash-chain page index in the style of vLLM's automatic prefix caching (one dict lookup per
page, keyed by the hash of the parent page's key and the page's tokens).
"""

from __future__ import annotations

import argparse
import gc
import platform
import time

import numpy as np
import torch

from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.memory.radix_cache import RadixCache


def make_sequences(kind: str, num: int, length: int, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    if kind == "random":
        return [row.tolist() for row in rng.integers(0, vocab, size=(num, length))]
    systems = [rng.integers(0, vocab, size=rng.integers(100, 401)).tolist() for _ in range(64)]
    shots = [[rng.integers(0, vocab, size=rng.integers(100, 301)).tolist() for _ in range(8)] for _ in range(64)]
    seqs = []
    for _ in range(num):
        s = int(rng.integers(64))
        head = systems[s] + shots[s][int(rng.integers(8))]
        tail = rng.integers(0, vocab, size=max(0, length - len(head))).tolist()
        seqs.append((head + tail)[:length])
    return seqs


class HashChainIndex:
    """Baseline: vLLM-style prefix index, page key = hash((parent key, page tokens))."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.table: dict[int, int] = {}

    def match(self, tokens: list[int]) -> list[int]:
        p, pages, parent = self.page_size, [], None
        for i in range(0, len(tokens) - p + 1, p):
            parent = hash((parent, tuple(tokens[i : i + p])))
            page = self.table.get(parent)
            if page is None:
                break
            pages.append(page)
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        p, parent = self.page_size, None
        for j, i in enumerate(range(0, len(pages) * p, p)):
            parent = hash((parent, tuple(tokens[i : i + p])))
            self.table.setdefault(parent, pages[j])


def per_call_us(fn, items) -> tuple[float, float]:
    """(median, mean) microseconds per call; the median resists preemption on a shared machine."""
    times = []
    clock = time.perf_counter
    gc.disable()
    try:
        for item in items:
            start = clock()
            fn(item)
            times.append(clock() - start)
    finally:
        gc.enable()
    arr = np.asarray(times) * 1e6
    return float(np.median(arr)), float(arr.mean())


def run(kind: str, page_size: int, num: int, length: int, vocab: int, probes: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    seqs = make_sequences(kind, num, length, vocab, rng)
    unseen = make_sequences(kind, probes, length, vocab, np.random.default_rng(seed + 1))
    if kind == "shared":  # unseen user parts after the same system prompts and shots
        unseen = [s[: length // 2] + u[length // 2 :] for s, u in zip(seqs[:probes], unseen)]
    pages_needed = num * (length // page_size) + 16
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=1, page_size=page_size, dtype=torch.float32)
    pool = PagePool(layout, pages_needed)
    cache = RadixCache(pool)
    aligned = [s[: len(s) // page_size * page_size] for s in seqs]

    match_build, insert_build = [], []
    gc.disable()
    for tokens in aligned:
        t0 = time.perf_counter()
        m = cache.match_prefix(tokens)
        t1 = time.perf_counter()
        own = pool.alloc(len(tokens) // page_size - len(m.pages))
        t2 = time.perf_counter()
        r = cache.insert(tokens, m.pages + own)
        t3 = time.perf_counter()
        pool.decref(r.duplicates)
        match_build.append(t1 - t0)
        insert_build.append(t3 - t2)
    gc.enable()
    match_build, insert_build = np.asarray(match_build) * 1e6, np.asarray(insert_build) * 1e6

    picks = [aligned[i] for i in np.random.default_rng(seed + 2).integers(0, num, size=probes)]
    out = {
        "cached_pages": cache.cached_pages,
        "nodes": cache.num_nodes,
        "build: match (new sequence) us": (float(np.median(match_build)), float(match_build.mean())),
        "build: insert (new sequence) us": (float(np.median(insert_build)), float(insert_build.mean())),
        "match cached (hit) us": per_call_us(lambda t: cache.match_prefix(t, record=False), picks),
        "match unseen us": per_call_us(lambda t: cache.match_prefix(t, record=False), unseen),
    }
    # Insert of an already cached sequence with the caller's own pages: every page comes back a duplicate.
    # (Fake page ids: insert touches no pool page for tokens the tree already holds.)
    dup_args = [(t, [-1] * (len(t) // page_size)) for t in picks]
    out["insert cached (all duplicate) us"] = per_call_us(lambda a: cache.insert(*a), dup_args)
    deep = [cache.match_prefix(t, record=False).node for t in picks[:200]]
    out["lock+unlock us"] = per_call_us(lambda n: (cache.lock(n), cache.unlock(n)), deep)
    cache.check()
    hit = sum(cache.match_prefix(u, record=False).num_tokens for u in unseen) / (probes * length)
    out["unseen hit fraction"] = hit

    baseline = HashChainIndex(page_size)
    for tokens in aligned:
        baseline.insert(tokens, [0] * (len(tokens) // page_size))
    out["baseline hash-chain match cached us"] = per_call_us(baseline.match, picks)
    out["baseline hash-chain match unseen us"] = per_call_us(baseline.match, unseen)

    start = time.perf_counter()
    freed = cache.evict(cache.cached_pages)
    out["evict all: us per page (mean)"] = (time.perf_counter() - start) / max(freed, 1) * 1e6
    assert pool.num_free == pool.num_pages
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=10_000)
    parser.add_argument("--seq-len", type=int, default=1000)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--workloads", nargs="+", default=["shared", "random"], choices=["shared", "random"])
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--probes", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        f"radix cache micro-benchmark: {args.num_seqs} sequences x {args.seq_len} tokens, vocab {args.vocab}, "
        f"{args.probes} probes, seed {args.seed}; python {platform.python_version()} on {platform.machine()}"
    )
    for kind in args.workloads:
        for page_size in args.page_sizes:
            res = run(kind, page_size, args.num_seqs, args.seq_len, args.vocab, args.probes, args.seed)
            print(f"\n[{kind}, page size {page_size}]")
            print(f"  {'':40s} {'median':>9s} {'mean':>9s}")
            for name, value in res.items():
                if isinstance(value, tuple):
                    print(f"  {name:40s} {value[0]:9.1f} {value[1]:9.1f}")
                elif isinstance(value, float):
                    print(f"  {name:40s} {value:9.3f}")
                else:
                    print(f"  {name:40s} {value:9d}")


if __name__ == "__main__":
    main()
