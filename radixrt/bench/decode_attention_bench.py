"""The CPU paged decode kernel on its own: one decode step's attention over every layer's KV pool.

    python -m radixrt.bench.decode_attention_bench [--batch 32] [--min-len 340] [--max-len 700] [--layers 30]
                                                   [--rows 1] [--dtype bfloat16|float32] [--rounds 10]

Builds ``--layers`` separate K/V caches (SmolLM2-135M's 9 query and 3 KV heads of 64, 16-token pages dealt out
in a shuffled order, as a busy pool deals them), then times a step: ``radixrt::paged_decode`` over each layer's
cache in turn, so that the pages come from memory as in a forward pass ("cold"), and one layer repeated
("warm": its pages in cache). Each path the kernel has here runs, alternating: bf16 on AMX tiles, on the bf16
dot product, and the portable one. ``--rows k``: each request as a speculative verify step's k decode rows (row i
over the request's keys and i more), a request's rows in one chunk as the runtime hands them to the kernel.
Each figure is the best round; GB/s is the K/V bytes read over the time (once a request).
"""

from __future__ import annotations

import argparse
import time

import torch

from radixrt.kernels import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16


def _paged_caches(lens: torch.Tensor, layers: int, dtype: torch.dtype, gen: torch.Generator):
    pages_of = [(int(n) + PAGE_SIZE - 1) // PAGE_SIZE for n in lens]
    num_pages = sum(pages_of) + 1
    table = torch.zeros(len(lens), max(pages_of), dtype=torch.int32)
    order = torch.randperm(num_pages, generator=gen).int()
    start = 0
    for b, count in enumerate(pages_of):
        table[b, :count] = order[start:start + count]
        start += count
    shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
              for _ in range(layers)]
    return caches, table


def _best(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=340)
    parser.add_argument("--max-len", type=int, default=700)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--rows", type=int, default=1, help="decode rows a request (a verify step's)")
    args = parser.parse_args(argv)
    if cpu_kernels.load() is None:
        print("the C++ CPU kernels are not built here")
        return 1
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=gen, dtype=torch.int32)
    caches, table = _paged_caches(lens + args.rows - 1, args.layers, dtype, gen)  # room for a verify step's rows
    layer_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
    chunks = None
    if args.rows > 1:  # each request's rows: its pages, one more key a row, in one chunk
        table = table.repeat_interleave(args.rows, dim=0).contiguous()
        lens = (lens.repeat_interleave(args.rows) + torch.arange(args.rows).repeat(args.batch)).int()
        as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
        chunks = cpu_kernels.CascadeChunks(rows=as_int(range(len(lens))),
                                           offsets=as_int(range(0, len(lens) + 1, args.rows)),
                                           groups=as_int([-1] * args.batch), shared_table=as_int([[0]]),
                                           shared_pages=as_int([0]))
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    paths = {"portable": {"portable": True}}
    if dtype == torch.bfloat16 and cpu_kernels.bf16_dot_built():
        paths = {"bf16 dot": {"tiles": False}, **paths}
        if cpu_kernels.decode_tiles_usable():
            paths = {"AMX tiles": {}, **paths}
    mean = float(lens.float().mean())
    print(f"{args.dtype}, batch {args.batch}, {args.min_len}-{args.max_len} keys (mean {mean:.0f}),"
          f" {args.rows} row(s) a request, {args.layers} layers, {torch.get_num_threads()} threads")
    print("| path | step ms (cold) | GB/s cold | one layer ms (warm) | GB/s warm |")
    print("|---|---:|---:|---:|---:|")
    rows = {name: [float("inf"), float("inf")] for name in paths}
    for _ in range(args.rounds):  # paths alternate within a round
        for name, path in paths.items():
            def step(path=path) -> None:
                for k, v in caches:
                    cpu_kernels.paged_decode(q, k, v, table, lens, HEAD_DIM**-0.5, 0, chunks, **path)

            def layer(path=path) -> None:
                cpu_kernels.paged_decode(q, *caches[0], table, lens, HEAD_DIM**-0.5, 0, chunks, **path)

            rows[name][0] = min(rows[name][0], _best(step, 1))
            rows[name][1] = min(rows[name][1], _best(layer, 3))
    for name, (cold, warm) in rows.items():
        print(f"| {name} | {cold * 1e3:.2f} | {layer_bytes * args.layers / cold / 1e9:.1f} | {warm * 1e3:.3f} |"
              f" {layer_bytes / warm / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
